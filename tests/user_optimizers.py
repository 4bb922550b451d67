"""Optimizer factories as a user writes them, for ``--optimizer tests.user_optimizers:NAME``
(and ``ps.serve(optimizer=NAME)``): each takes the model's named parameters and returns a
``torch.optim.Optimizer`` with its parameter groups."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def adamw_groups(named: Iterable[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """AdamW, decay 0.1 on matrices at lr 0.01; biases and norms without decay at 0.02."""
    named = list(named)
    matrices = [p for _, p in named if p.dim() >= 2]
    rest = [p for _, p in named if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": matrices, "weight_decay": 0.1},
            {"params": rest, "weight_decay": 0.0, "lr": 0.02},
        ],
        lr=0.01,
        betas=(0.9, 0.95),
        eps=1e-7,
    )


def sgd_nesterov(named: Iterable[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9, nesterov=True)


def rmsprop(named: Iterable[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.RMSprop([p for _, p in named], lr=0.01)


def not_an_optimizer(named: Iterable[tuple[str, nn.Parameter]]) -> list:
    return list(named)
