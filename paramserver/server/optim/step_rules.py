"""What a server's step does to a gradient besides the optimizer's own update: the global
norm clip (``--clip-grad-norm``, torch's ``clip_grad_norm_`` over the whole model) and weight
decay on the matrices only (``--weight-decay-on matrices``: none on biases, normalisation
layers and embeddings, a transformer's two parameter groups), over the one flat buffer the
optimizer steps. The decay is then applied here, as the optimizer would have (decoupled for
AdamW, ``p *= 1 - lr * wd`` before its update; added to the gradient, ``g += wd * p``, for
the others), on the decayed elements only, so the result is torch's with two groups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from paramserver.codec.layout import Manifest

Ranges = Sequence[tuple[int, int]]


def decayed_ranges(
    model: nn.Module, whole: Manifest, lo: int, n_params: int
) -> list[tuple[int, int]]:
    """The elements of this shard's parameters (``n_params`` of them, from ``lo`` in the
    whole flat buffer ``whole``) that ``--weight-decay-on matrices`` decays: those of
    parameters of two or more dimensions that are not an embedding's weight (a head tied
    to one is the embedding), as ``[a, b)`` ranges local to the shard."""
    embeddings = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)
    }
    matrices = {n for n, p in model.named_parameters() if p.dim() >= 2 and id(p) not in embeddings}
    out = []
    for t in whole.tensors:
        if t.role != "param" or t.name not in matrices:
            continue
        a, b = max(t.start, lo), min(t.start + t.numel, lo + n_params)
        if a < b:
            out.append((a - lo, b - lo))
    return out


def clipped(grad: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``grad`` scaled as ``clip_grad_norm_(max_norm)`` scales a model's gradients: by
    ``min(1, max_norm / (norm + 1e-6))``, ``norm`` its L2 norm (a new tensor)."""
    norm = torch.linalg.vector_norm(grad.float())
    return grad * torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(grad.dtype)


def decay(
    param: torch.Tensor, grad: torch.Tensor, ranges: Ranges, lr: float, wd: float, decoupled: bool
) -> None:
    """Weight decay ``wd`` at rate ``lr`` on ``ranges`` of ``param``: decoupled (AdamW's:
    the parameters shrink before the update), or into ``grad`` (which the caller owns)."""
    with torch.no_grad():
        for a, b in ranges:
            if decoupled:
                param[a:b].mul_(1.0 - lr * wd)
            else:
                grad[a:b].add_(param[a:b], alpha=wd)


# Ranges of parameters without a gradient, with their weights and per-element state
Kept = list[tuple[int, int, torch.Tensor, dict[str, torch.Tensor]]]


def keep(param: torch.Tensor, state: dict[str, Any], idle: Sequence[tuple[int, int]]) -> Kept:
    """Copies of the weights and per-element optimizer ``state`` of each range of ``idle``
    (``codec/idle.py``), before a step over the whole flat ``param``."""
    per_element = {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == param.shape}
    return [
        (lo, hi, param.data[lo:hi].clone(), {k: v[lo:hi].clone() for k, v in per_element.items()})
        for lo, hi in idle
    ]


def put_back(param: torch.Tensor, state: dict[str, Any], kept: Kept) -> None:
    """The ranges ``keep`` copied, as they were after the step; state the step made for
    the first time starts at zero there (as torch's would when the parameter first steps)."""
    with torch.no_grad():
        for lo, hi, weights, saved in kept:
            param.data[lo:hi] = weights
            for k, v in state.items():
                if torch.is_tensor(v) and v.shape == param.shape:
                    v[lo:hi] = saved.get(k, 0)
