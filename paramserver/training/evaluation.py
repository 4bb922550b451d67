"""A model's test figures: accuracy and mean cross-entropy, and for a two-class model (a
click model) the area under the ROC curve of its click logit."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.training.clicks import auc


class Evaluation(NamedTuple):
    accuracy: float
    loss: float
    auc: float | None = None  # two-class models only


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 2000) -> Evaluation:
    """``evaluate_batches`` over ``(x, y)`` in slices of ``batch``."""
    return evaluate_batches(
        model, ((x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch))
    )


@torch.no_grad()
def evaluate_batches(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> Evaluation:
    """Accuracy, mean cross-entropy and (two classes) AUC of ``model`` over ``batches`` of
    (inputs, labels), in eval mode."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct, loss, n = 0, 0.0, 0
    scores: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for x, y in batches:
        out = model(x.to(device))
        target = y.to(device)
        loss += F.cross_entropy(out, target, reduction="sum").item()
        correct += (out.argmax(1) == target).sum().item()
        n += len(target)
        if out.shape[1] == 2:
            scores.append((out[:, 1] - out[:, 0]).float().cpu().numpy())
            labels.append(y.cpu().numpy())
    model.train(was_training)
    area = auc(np.concatenate(scores), np.concatenate(labels)) if scores else None
    return Evaluation(correct / max(n, 1), loss / max(n, 1), area)
