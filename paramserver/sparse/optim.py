"""Row-wise optimizers: a step updates the touched rows only, as torch's sparse optimizers
do, and keeps state (adagrad's sums, adam's moments) for rows that were touched.

- ``sgd``: torch.optim.SGD on a sparse gradient.
- ``adagrad``: torch.optim.Adagrad on a sparse gradient (no learning-rate decay): a sum of
  squares per element.
- ``rowwise-adagrad``: one accumulator per row, the usual choice for embedding rows
  (FBGEMM's and TorchRec's ROWWISE_ADAGRAD): ``G[r] += mean(g[r]**2)``, then
  ``w[r] -= lr * g[r] / (sqrt(G[r]) + eps)``; a row's state is one number, not ``dim``.
- ``adam``: lazy Adam: the moments of untouched rows stay as they are, and the bias
  correction counts the steps of each row (its pushes), as DeepRec's AdamAsync does, so a
  row trains the same whichever shard holds it and however many shards there are (torch's
  SparseAdam counts the table's steps, which a shard cannot know of the others').

sgd and adagrad are the same operations in the same order as torch, so a table trained
here equals an ``nn.Embedding(sparse=True)`` trained by torch (tested); rowwise-adagrad and
adam equal references written from their definitions (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paramserver.config import ROW_OPTIMIZERS

_EPS = {"adagrad": 1e-10, "rowwise-adagrad": 1e-8, "adam": 1e-8}  # torch's; FBGEMM's


@dataclass(frozen=True)
class RowOptimizerConfig:
    name: str = "sgd"
    lr: float = 0.01
    eps: float | None = None  # None: the optimizer's default (adagrad 1e-10, the others 1e-8)
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

    def state_layout(self, dim: int) -> list[tuple[int, torch.dtype | None]]:
        """Per-row state tensors as (width, dtype; None: the table's): adagrad's sums,
        rowwise-adagrad's one sum, adam's two moments and its steps of the row."""
        layouts: dict[str, list[tuple[int, torch.dtype | None]]] = {
            "sgd": [],
            "adagrad": [(dim, None)],
            "rowwise-adagrad": [(1, None)],
            "adam": [(dim, None), (dim, None), (1, torch.int64)],
        }
        return layouts[self.name]

    def initial_state(self) -> float:
        return self.initial_accumulator_value if "adagrad" in self.name else 0.0

    @property
    def epsilon(self) -> float:
        return _EPS.get(self.name, 0.0) if self.eps is None else self.eps


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
        ``lr`` (None: the config's; the server passes its schedule's). ``steps`` counts the
        table's steps here (adam's bias correction counts each row's own, in its state)."""
        self.steps += 1
        # the schedule's rate as it is: 0 at the end of a cosine (not a config, which
        # refuses a rate of 0)
        cfg, rate = self.config, self.config.lr if lr is None else lr
        if cfg.name == "sgd":
            values.index_add_(0, slots, grads, alpha=-rate)
        elif cfg.name == "adagrad":
            (total,) = state
            total.index_add_(0, slots, grads.pow(2))
            std = total[slots].sqrt_().add_(cfg.epsilon)
            values.index_add_(0, slots, grads / std, alpha=-rate)
        elif cfg.name == "rowwise-adagrad":
            (total,) = state
            total.index_add_(0, slots, grads.pow(2).mean(dim=1, keepdim=True))
            std = total[slots].sqrt_().add_(cfg.epsilon)
            values.index_add_(0, slots, grads / std, alpha=-rate)
        else:
            _lazy_adam(cfg, rate, values, state, slots, grads)


def _lazy_adam(
    cfg: RowOptimizerConfig,
    rate: float,
    values: torch.Tensor,
    state: list[torch.Tensor],
    slots: torch.Tensor,
    grads: torch.Tensor,
) -> None:
    """SparseAdam's update of the rows at ``slots``, each bias-corrected by its own steps."""
    exp_avg, exp_avg_sq, steps = state
    old_avg, old_sq = exp_avg[slots], exp_avg_sq[slots]
    avg_update = grads.sub(old_avg).mul_(1 - cfg.beta1)
    exp_avg.index_add_(0, slots, avg_update)
    sq_update = grads.pow(2).sub_(old_sq).mul_(1 - cfg.beta2)
    exp_avg_sq.index_add_(0, slots, sq_update)
    steps.index_add_(0, slots, torch.ones((len(slots), 1), dtype=steps.dtype))
    t = steps[slots].to(torch.float64)
    step_size = (rate * (1 - cfg.beta2**t).sqrt() / (1 - cfg.beta1**t)).to(values.dtype)
    numer = avg_update.add_(old_avg)
    denom = sq_update.add_(old_sq).sqrt_().add_(cfg.epsilon)
    values.index_add_(0, slots, numer.div_(denom).mul_(step_size), alpha=-1.0)
