"""One shard's rows of one table: created on first touch from the seeded initialiser,
pulled and pushed by id, updated by a row-wise optimizer, saved and restored.

Every request is checked whole before anything changes: ids must be integers in
[0, rows), held by this shard, and a push's ids distinct with one finite row of ``dim``
values each. A bad request raises ``InvalidRequest`` (INVALID_ARGUMENT on the wire) and
leaves the table as it was.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paramserver.codec.rows import TableSpec
from paramserver.errors import InvalidRequest
from paramserver.sparse.index import RowIndex
from paramserver.sparse.optim import RowOptimizer, RowOptimizerConfig
from paramserver.sparse.rows import initial_rows, shard_of, table_key


class ShardTable:
    """The rows of ``spec`` that shard ``shard`` of ``shards`` holds."""

    def __init__(
        self,
        spec: TableSpec,
        optimizer: RowOptimizerConfig,
        seed: int = 0,
        shard: int = 0,
        shards: int = 1,
        capacity: int = 1024,
    ):
        self.spec, self.shard, self.shards = spec, shard, shards
        self.key = table_key(seed, spec.name)
        self.optimizer = RowOptimizer(optimizer)
        self.index = RowIndex(capacity)
        dtype = getattr(torch, spec.dtype)
        self.values = torch.empty((capacity, spec.dim), dtype=dtype)
        self.state = [
            torch.empty((capacity, spec.dim), dtype=dtype) for _ in range(optimizer.state_width)
        ]

    @property
    def held(self) -> int:
        """Rows created so far (touched at least once)."""
        return len(self.index)

    # --- checks -----------------------------------------------------------------------

    def check_ids(self, ids: Any, what: str) -> np.ndarray:
        """``ids`` as int64, or InvalidRequest naming what is wrong."""
        arr = np.asarray(ids)
        if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise InvalidRequest(
                f"{what} of table {self.spec.name!r}: ids must be a 1-D "
                f"array of integers, not {arr.dtype} of shape {arr.shape}."
            )
        arr = arr.astype(np.int64, copy=False)
        bad = (arr < 0) | (arr >= self.spec.rows)
        if bad.any():
            raise InvalidRequest(
                f"{what} of table {self.spec.name!r}: id {int(arr[bad][0])} is "
                f"outside [0, {self.spec.rows})."
            )
        if self.shards > 1:
            elsewhere = shard_of(arr, self.shards) != self.shard
            if elsewhere.any():
                raise InvalidRequest(
                    f"{what} of table {self.spec.name!r}: id {int(arr[elsewhere][0])} belongs "
                    f"to shard {int(shard_of(arr[elsewhere][:1], self.shards)[0])}, not "
                    f"{self.shard}."
                )
        return arr

    def check_push(
        self, ids: Any, grads: Any, nonfinite: bool = False
    ) -> tuple[np.ndarray, torch.Tensor]:
        """``ids`` and ``grads`` as a push applies them, or InvalidRequest; changes nothing.
        ``nonfinite``: NaN or Inf passes (the server skips the push, ``--skip-nonfinite``)."""
        arr = self.check_ids(ids, "A push")
        if len(np.unique(arr)) != len(arr):
            raise InvalidRequest(
                f"A push of table {self.spec.name!r} names an id twice; coalesce the rows first."
            )
        g = torch.as_tensor(grads)
        if g.dtype != self.values.dtype or tuple(g.shape) != (len(arr), self.spec.dim):
            raise InvalidRequest(
                f"A push of table {self.spec.name!r}: gradients of {g.dtype} {tuple(g.shape)} "
                f"for {len(arr)} ids; expected {self.values.dtype} "
                f"({len(arr)}, {self.spec.dim})."
            )
        if not nonfinite and not bool(torch.isfinite(g).all()):
            raise InvalidRequest(f"A push of table {self.spec.name!r} holds NaN or Inf.")
        return arr, g

    # --- rows -------------------------------------------------------------------------

    def _slots(self, ids: np.ndarray) -> torch.Tensor:
        """The slots of ``ids`` (distinct), creating the rows never touched."""
        slots = self.index.find(ids)
        new = slots < 0
        if new.any():
            fresh = ids[new]
            slots[new] = self.index.insert(fresh)
            self._reserve(len(self.index))
            start = len(self.index) - len(fresh)
            self.values[start : len(self.index)] = torch.from_numpy(
                initial_rows(self.key, fresh, self.spec.dim, self.spec.dtype)
            )
            for s in self.state:
                s[start : len(self.index)] = self.optimizer.config.initial_state()
        return torch.from_numpy(slots)

    def _reserve(self, n: int) -> None:
        if n <= len(self.values):
            return
        size = max(n, 2 * len(self.values))

        def grown(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty((size, self.spec.dim), dtype=t.dtype)
            out[: len(t)] = t
            return out

        self.values = grown(self.values)
        self.state = [grown(s) for s in self.state]

    def pull(self, ids: Any) -> torch.Tensor:
        """The rows ``ids`` (any order, repeats allowed): (len(ids), dim), a copy."""
        return self.pull_checked(self.check_ids(ids, "A pull"))

    def pull_checked(self, arr: np.ndarray) -> torch.Tensor:
        """``pull`` of ids that ``check_ids`` returned."""
        unique, inverse = np.unique(arr, return_inverse=True)
        slots = self._slots(unique)  # may grow (replace) self.values: first
        return self.values[slots[torch.from_numpy(inverse.reshape(-1))]]

    def push(self, ids: Any, grads: Any) -> None:
        """One optimizer step on rows ``ids`` (distinct) with ``grads`` (one row each)."""
        self.apply(*self.check_push(ids, grads))

    def apply(self, ids: np.ndarray, grads: torch.Tensor, lr: float | None = None) -> None:
        """``push`` of what ``check_push`` returned (at ``lr``; None: the optimizer's)."""
        slots = self._slots(ids)  # may grow (replace) self.values and self.state: first
        self.optimizer.step(self.values, self.state, slots, grads, lr)

    def read(self, ids: Any) -> torch.Tensor:
        """The current values of rows ``ids`` without creating any (untouched rows: their
        initial values), for checkpoints and ``model_state_dict``."""
        arr = self.check_ids(ids, "A read")
        slots = self.index.find(arr)
        out = torch.from_numpy(initial_rows(self.key, arr, self.spec.dim, self.spec.dtype))
        held = torch.from_numpy(slots >= 0)
        out[held] = self.values[torch.from_numpy(slots[slots >= 0])]
        return out

    # --- saving -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        ids, slots = self.index.items()
        take = torch.from_numpy(slots)
        return {
            "ids": torch.from_numpy(ids),
            "values": self.values[take].clone(),
            "state": [s[take].clone() for s in self.state],
            "steps": self.optimizer.steps,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        ids = self.check_ids(saved["ids"].numpy(), "A restored table")
        if len(saved["state"]) != len(self.state):
            raise ValueError(
                f"Table {self.spec.name!r}: the saved optimizer state does not "
                f"match {self.optimizer.config.name}."
            )
        self.index = RowIndex(max(1024, 2 * len(ids)))
        slots = torch.from_numpy(self.index.insert(ids))
        self._reserve(len(ids))
        self.values[slots] = saved["values"].to(self.values.dtype)
        for mine, theirs in zip(self.state, saved["state"], strict=True):
            mine[slots] = theirs.to(mine.dtype)
        self.optimizer.steps = int(saved["steps"])
