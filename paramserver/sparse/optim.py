"""Row-wise optimizers: a step updates the touched rows only, as torch's sparse optimizers
do, and keeps state (adagrad's sums, adam's moments) for rows that were touched.

- ``sgd``: torch.optim.SGD on a sparse gradient.
- ``adagrad``: torch.optim.Adagrad on a sparse gradient (no learning-rate decay).
- ``adam``: lazy Adam, torch.optim.SparseAdam: the moments of untouched rows stay as they
  are, and the bias correction counts every step of the table (``steps``).

The same operations in the same order as torch, so a table trained here equals an
``nn.Embedding(sparse=True)`` trained by torch (tested).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

ROW_OPTIMIZERS = ("sgd", "adagrad", "adam")


@dataclass(frozen=True)
class RowOptimizerConfig:
    name: str = "sgd"
    lr: float = 0.01
    eps: float | None = None  # None: torch's default (adagrad 1e-10, adam 1e-8)
    beta1: float = 0.9
    beta2: float = 0.999
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in ROW_OPTIMIZERS:
            raise ValueError(
                f"A table's optimizer is one of {', '.join(ROW_OPTIMIZERS)}; got {self.name!r}."
            )
        if not self.lr > 0:
            raise ValueError(f"A table's learning rate must be positive; got {self.lr}.")

    @property
    def state_width(self) -> int:
        """Per-row state tensors: none, adagrad's sum, or adam's two moments."""
        return {"sgd": 0, "adagrad": 1, "adam": 2}[self.name]

    def initial_state(self) -> float:
        return self.initial_accumulator_value if self.name == "adagrad" else 0.0


class RowOptimizer:
    """Steps of one table: ``step(values, state, slots, grads)``."""

    def __init__(self, config: RowOptimizerConfig):
        self.config = config
        self.steps = 0

    def step(
        self,
        values: torch.Tensor,
        state: list[torch.Tensor],
        slots: torch.Tensor,
        grads: torch.Tensor,
        lr: float | None = None,
    ) -> None:
        """Update rows ``values[slots]`` with ``grads`` (one row each, slots distinct) at
        ``lr`` (None: the config's; the server passes its schedule's). An empty push still
        counts as a step (adam's bias correction)."""
        self.steps += 1
        cfg = self.config if lr is None else dataclasses.replace(self.config, lr=lr)
        if cfg.name == "sgd":
            values.index_add_(0, slots, grads, alpha=-cfg.lr)
        elif cfg.name == "adagrad":
            (total,) = state
            total.index_add_(0, slots, grads.pow(2))
            std = total[slots].sqrt_().add_(1e-10 if cfg.eps is None else cfg.eps)
            values.index_add_(0, slots, grads / std, alpha=-cfg.lr)
        else:
            exp_avg, exp_avg_sq = state
            eps = 1e-8 if cfg.eps is None else cfg.eps
            old_avg, old_sq = exp_avg[slots], exp_avg_sq[slots]
            avg_update = grads.sub(old_avg).mul_(1 - cfg.beta1)
            exp_avg.index_add_(0, slots, avg_update)
            sq_update = grads.pow(2).sub_(old_sq).mul_(1 - cfg.beta2)
            exp_avg_sq.index_add_(0, slots, sq_update)
            numer = avg_update.add_(old_avg)
            denom = sq_update.add_(old_sq).sqrt_().add_(eps)
            bias1 = 1 - cfg.beta1**self.steps
            bias2 = 1 - cfg.beta2**self.steps
            step_size = cfg.lr * math.sqrt(bias2) / bias1
            values.index_add_(0, slots, numer.div_(denom), alpha=-step_size)
