"""One shard's rows of one table: created by their first push from the seeded initialiser,
pulled and pushed by id, updated by a row-wise optimizer, saved and restored.

A pull creates nothing: it reads the rows held and gives the initial values of the others
(``Lookup``). What a pull does under the lock pushes wait on is a copy of the rows held;
the initial values of the rest are computed after it, in chunks of bounded size.

Every request is checked whole before anything changes: ids must be integers in
[0, rows), held by this shard, and a push's ids distinct with one finite row of ``dim``
values each. A bad request raises ``InvalidRequest`` (INVALID_ARGUMENT on the wire) and
leaves the table as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paramserver.codec.rows import TableSpec
from paramserver.errors import InvalidRequest
from paramserver.sparse.index import RowIndex
from paramserver.sparse.optim import RowOptimizer, RowOptimizerConfig
from paramserver.sparse.rows import initial_rows, shard_of, table_key

INITIAL_CHUNK = 1 << 16  # ids whose initial values are computed at once (bounded temporaries)


@dataclass(frozen=True)
class Lookup:
    """A pull's rows of one table as read under the lock: ``values`` are the rows held
    (``held`` marks their ids); ``complete`` adds the initial values of the rest."""

    ids: np.ndarray
    held: np.ndarray  # bool, one per id
    values: torch.Tensor  # (held.sum(), dim), a copy
    key: np.uint64
    dim: int
    dtype: str

    def complete(self) -> torch.Tensor:
        """The rows of ``ids``: (len(ids), dim); the initial values computed a chunk of
        ``INITIAL_CHUNK`` ids at a time."""
        out = torch.empty((len(self.ids), self.dim), dtype=getattr(torch, self.dtype))
        out[torch.from_numpy(self.held)] = self.values
        missing = np.flatnonzero(~self.held)
        for lo in range(0, len(missing), INITIAL_CHUNK):
            part = missing[lo : lo + INITIAL_CHUNK]
            initial = initial_rows(self.key, self.ids[part], self.dim, self.dtype)
            out[torch.from_numpy(part)] = torch.from_numpy(initial)
        return out


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
            torch.empty((capacity, width), dtype=kind or dtype)
            for width, kind in optimizer.state_layout(spec.dim)
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
            out = torch.empty((size, t.shape[1]), dtype=t.dtype)
            out[: len(t)] = t
            return out

        self.values = grown(self.values)
        self.state = [grown(s) for s in self.state]

    def pull(self, ids: Any) -> torch.Tensor:
        """The rows ``ids`` (any order, repeats allowed): (len(ids), dim), a copy; the
        initial values of rows not held, none of which is created."""
        return self.lookup(self.check_ids(ids, "A pull")).complete()

    def lookup(self, arr: np.ndarray) -> Lookup:
        """The rows held among ids that ``check_ids`` returned, copied; creates nothing."""
        slots = self.index.find(arr)
        held = slots >= 0
        values = self.values[torch.from_numpy(slots[held])]
        return Lookup(arr, held, values, self.key, self.spec.dim, self.spec.dtype)

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
        return self.lookup(self.check_ids(ids, "A read")).complete()

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
        states = list(saved["state"])
        if self.optimizer.config.name == "adam" and len(states) == 2:
            # a checkpoint from before adam counted each row's steps: the table's, for all
            states.append(torch.full((len(ids), 1), int(saved["steps"]), dtype=torch.int64))
        if len(states) != len(self.state):
            raise ValueError(
                f"Table {self.spec.name!r}: the saved optimizer state does not "
                f"match {self.optimizer.config.name}."
            )
        self.index = RowIndex(max(1024, 2 * len(ids)))
        slots = torch.from_numpy(self.index.insert(ids))
        self._reserve(len(ids))
        self.values[slots] = saved["values"].to(self.values.dtype)
        for mine, theirs in zip(self.state, states, strict=True):
            mine[slots] = theirs.to(mine.dtype)
        self.optimizer.steps = int(saved["steps"])
