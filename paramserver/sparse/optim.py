"""Row-wise optimizers: a step updates the touched rows only, as torch's sparse optimizers
do, and keeps state (adagrad's sums, adam's moments) for rows that were touched.

- ``sgd``: torch.optim.SGD on a sparse gradient.
- ``adagrad``: torch.optim.Adagrad on a sparse gradient (no learning-rate decay): a sum of
  squares per element.
- ``rowwise-adagrad``: one accumulator per row, the usual choice for embedding rows
  (FBGEMM's and TorchRec's ROWWISE_ADAGRAD): ``G[r] += mean(g[r]**2)``, then
  ``w[r] -= lr * g[r] / (sqrt(G[r]) + eps)``; a row's state is one number, not ``dim``.
- ``sparse-adam``: torch.optim.SparseAdam: the moments of untouched rows stay as they are,
  and the bias correction counts the table's steps (the pushes that reached the table on
  this shard; every push reaches every shard when its batch names rows there, which a
  batch of any size does on every shard). A rare row's first steps are then up to 3.16 x
  ``lr`` (its moments start at 0 while the table's count is high): on the click log's 1M-row
  DLRM this reached 0.7567 AUC in one process where ``adam`` reached 0.7366 (docs/architecture.md,
  issue 44). The default for a table under ``--optimizer adam`` or ``adamw``.
- ``adam``: lazy Adam whose bias correction counts the steps of each row (its pushes), as
  DeepRec's AdamAsync does: a row trains the same whichever shard holds it and however
  many shards there are, and a rare row's first step is ``lr``.

sgd, adagrad and sparse-adam are torch's operations, so a table trained here equals an
``nn.Embedding(sparse=True)`` trained by torch (tested); rowwise-adagrad and adam equal
references written from their definitions (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from paramserver.config import ROW_OPTIMIZERS

# torch's; FBGEMM's
_EPS = {"adagrad": 1e-10, "rowwise-adagrad": 1e-8, "adam": 1e-8, "sparse-adam": 1e-8}


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
        rowwise-adagrad's one sum, sparse-adam's two moments, adam's two moments and the
        row's steps."""
        layouts: dict[str, list[tuple[int, torch.dtype | None]]] = {
            "sgd": [],
            "adagrad": [(dim, None)],
            "rowwise-adagrad": [(1, None)],
            "adam": [(dim, None), (dim, None), (1, torch.int64)],
            "sparse-adam": [(dim, None), (dim, None)],
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
        table's steps here (sparse-adam's bias correction; adam counts each row's own, in
        its state)."""
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
        elif cfg.name == "sparse-adam":
            _lazy_adam(cfg, rate, values, state, slots, grads, self.steps)
        else:
            _lazy_adam(cfg, rate, values, state, slots, grads)


def _lazy_adam(
    cfg: RowOptimizerConfig,
    rate: float,
    values: torch.Tensor,
    state: list[torch.Tensor],
    slots: torch.Tensor,
    grads: torch.Tensor,
    table_steps: int | None = None,
) -> None:
    """SparseAdam's update of the rows at ``slots``, bias-corrected by the table's
    ``table_steps`` (sparse-adam) or, None, by each row's own steps (adam, the third state
    tensor): the moments gathered once, moved (``lerp``: ``m + w * (g - m)``, the same
    operations as adding ``(g - m) * w``) and written back, the bias correction of each
    row's step count looked up (``_corrections``); 16 torch calls a table instead of 28
    (issue 44: a Criteo push steps 26 tables), 13 with the table's count."""
    if not len(slots):
        return
    exp_avg, exp_avg_sq = state[0], state[1]
    avg = exp_avg.index_select(0, slots).lerp_(grads, 1 - cfg.beta1)
    sq = exp_avg_sq.index_select(0, slots).lerp_(grads * grads, 1 - cfg.beta2)
    exp_avg.index_copy_(0, slots, avg)
    exp_avg_sq.index_copy_(0, slots, sq)
    step_size: torch.Tensor | float
    if table_steps is None:
        t = state[2].index_select(0, slots).add_(1)
        state[2].index_copy_(0, slots, t)
        step_size = _corrections(cfg.beta1, cfg.beta2, t, values.dtype).mul_(rate)
    else:  # torch's SparseAdam: lr * sqrt(1 - beta2**t) / (1 - beta1**t), in float64
        n = max(table_steps, 1)
        step_size = rate * math.sqrt(1 - cfg.beta2**n) / (1 - cfg.beta1**n)
    update = avg.div_(sq.sqrt_().add_(cfg.epsilon)).mul_(step_size)
    # read, subtract, write back: index_add_ took 1.3 ms for 9,361 rows of 16 here, the
    # three calls 0.4 (slots are distinct, so the result is the same)
    values.index_copy_(0, slots, values.index_select(0, slots).sub_(update))


_TABLE_STEPS = 1 << 16  # bias corrections tabled for a row's first 65,536 steps
_TABLES: dict[tuple[float, float, torch.dtype], torch.Tensor] = {}


def _corrections(beta1: float, beta2: float, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Adam's bias correction ``sqrt(1 - beta2**t) / (1 - beta1**t)`` of each step count
    in ``t`` ((n, 1) int64, each at least 1), computed in float64 and given in ``dtype``:
    looked up in a table of the first ``_TABLE_STEPS`` counts, computed past them. A copy."""
    key = (beta1, beta2, dtype)
    table = _TABLES.get(key)
    if table is None:
        n = torch.arange(_TABLE_STEPS + 1, dtype=torch.float64).clamp_(min=1)
        table = _TABLES[key] = ((1 - beta2**n).sqrt() / (1 - beta1**n)).to(dtype)
    if int(t.max()) <= _TABLE_STEPS:
        return table.index_select(0, t.view(-1)).view(-1, 1)
    n = t.to(torch.float64)
    return ((1 - beta2**n).sqrt() / (1 - beta1**n)).to(dtype)
