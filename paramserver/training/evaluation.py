"""A model's test figures: accuracy and mean loss (cross-entropy, or the run's ``--loss``),
with the perplexity of a sequence model's cross-entropy, and for a two-class model (a click model) the area
under the ROC curve of its click logit. A sequence output ((B, T, V) logits against (B, T)
targets) is counted token by token (``losses.per_token``): a run of 100 sequences of 64
tokens is 6,400 samples here."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.training.clicks import auc
from paramserver.training.losses import Loss, per_token


class Evaluation(NamedTuple):
    accuracy: float  # nan where the outputs are not classes of the targets
    loss: float
    auc: float | None = None  # two-class models only
    perplexity: float | None = None  # exp(loss) of a sequence model's cross-entropy, else None


def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 2000, loss: Loss | None = None
) -> Evaluation:
    """``evaluate_batches`` over ``(x, y)`` in slices of ``batch``."""
    return evaluate_batches(
        model, ((x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch)), loss
    )


@torch.no_grad()
def evaluate_batches(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss: Loss | None = None,
) -> Evaluation:
    """Accuracy, mean loss, perplexity and (two classes) AUC of ``model`` over ``batches``
    of (inputs, targets), in eval mode, a sequence's tokens each a sample. ``loss``: the
    run's own (``--loss``: a batch's mean, weighted by its samples here); None:
    cross-entropy."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct, total, n = 0, 0.0, 0
    classes = True  # every output a row of class scores for an integer target
    sequence = False  # outputs of tokens: (B, T, V) against (B, T)
    scores: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for x, y in batches:
        raw, raw_target = model(x.to(device)), y.to(device)
        out, target = per_token(raw, raw_target)
        sequence = sequence or out.dim() != raw.dim()
        if loss is None:
            total += F.cross_entropy(out, target, reduction="sum").item()
        else:
            total += float(loss(raw, raw_target)) * len(target)
        classes = (
            classes and out.dim() == 2 and target.dim() == 1 and not target.is_floating_point()
        )
        if classes:
            correct += int((out.argmax(1) == target).sum())
        n += len(target)
        if classes and out.shape[1] == 2:
            scores.append((out[:, 1] - out[:, 0]).float().cpu().numpy())
            labels.append(target.cpu().numpy())
    model.train(was_training)
    area = auc(np.concatenate(scores), np.concatenate(labels)) if scores and classes else None
    mean = total / max(n, 1)
    ppl = loss is None and sequence
    perplexity = math.exp(min(mean, 700.0)) if ppl else None  # exp(710) overflows
    accuracy = correct / max(n, 1) if classes else math.nan
    return Evaluation(accuracy, mean, area, perplexity)
