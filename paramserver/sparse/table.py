"""One shard's rows of one table: created by their first push (or their admission) from
the table's initialiser, pulled and pushed by id, updated by a row-wise optimizer, evicted
by its lifecycle (``lifecycle.py``), saved and restored.

A pull creates nothing: it reads the rows held and gives the initial values (or zeros,
``unadmitted``) of the others (``Lookup``). What a pull does under the lock pushes wait on
is a copy of the rows held; the initial values of the rest are computed after it, in
chunks of bounded size.

Storage: the rows, their optimizer state and their counters (pushes, last step pushed) sit
in arrays indexed by slot (``index.RowIndex``); an evicted row's slot is reused. The
arrays double when full, and only the slots handed out are ever written, so resident
memory follows the most rows held at once (241 bytes a row for lazy Adam at dim 16,
``bench/tables/row_memory.py``).

Every request is checked whole before anything changes: ids must be integers in
[0, rows) (any int64 for an unbounded table), held by this shard, and a push's ids
distinct with one finite row of ``dim`` values each. A bad request raises
``InvalidRequest`` (INVALID_ARGUMENT on the wire) and leaves the table as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paramserver.codec.rows import TableSpec
from paramserver.errors import InvalidRequest
from paramserver.sparse import lifecycle as life
from paramserver.sparse.index import index_for
from paramserver.sparse.initial import Recent, Wanted, initial_values, initial_values_many
from paramserver.sparse.optim import RowOptimizer, RowOptimizerConfig
from paramserver.sparse.rows import Init, shard_of, table_key


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
    init: Init | None  # None: rows not held read as zeros
    mix: bool = False  # an unbounded table's: see ``initial_values``
    recent: Recent | None = None  # where its initial values are kept (the shard's)

    def complete(self) -> torch.Tensor:
        """The rows of ``ids``: (len(ids), dim); the initial values computed a chunk of
        ``INITIAL_CHUNK`` ids at a time."""
        return complete_all([self])[0]


def complete_all(found: Sequence[Lookup]) -> list[torch.Tensor]:
    """Each lookup's ``complete()``: the initial values of the rows not held, of every
    lookup of one width, dtype, initialiser and id mixing, computed in one pass (a Criteo
    pull names 26 tables: one pass instead of 26)."""
    outs = []
    wanted: list[Wanted] = []
    filled: list[tuple[torch.Tensor, np.ndarray]] = []  # (a lookup's rows, where to fill)
    for f in found:
        out = torch.zeros((len(f.ids), f.dim), dtype=getattr(torch, f.dtype))
        out[torch.from_numpy(f.held)] = f.values
        outs.append(out)
        if f.init is not None and not f.held.all():
            missing = np.flatnonzero(~f.held)
            wanted.append((f.key, f.ids[missing], f.dim, f.dtype, f.init, f.mix))
            filled.append((out, missing))
    recent = next((f.recent for f in found if f.recent is not None), None)
    for (out, missing), values in zip(filled, initial_values_many(wanted, recent), strict=True):
        out[torch.from_numpy(missing)] = values
    return outs


def _grown_counts(counts: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, counts.dtype)  # calloc: pages untouched until written
    out[: len(counts)] = counts
    return out


# Rows prepared before the lock: the sorted ids found not held, and their initial values.
Prepared = tuple[np.ndarray, torch.Tensor]


class ShardTable:
    """The rows of ``spec`` that shard ``shard`` of ``shards`` holds."""

    def __init__(
        self,
        spec: TableSpec,
        optimizer: RowOptimizerConfig,
        seed: int = 0,
        shard: int = 0,
        shards: int = 1,
        reserve: int = 1024,
        lifecycle: life.Lifecycle | None = None,
    ):
        self.spec, self.shard, self.shards = spec, shard, shards
        self.key = table_key(seed, spec.name)
        self.init = Init.parse(spec.init)
        self.lifecycle = (lifecycle or life.Lifecycle()).checked(spec.name)
        self.recent: Recent | None = None  # the shard's kept initial values (``TableSet``'s)
        self.sketch = life.Sketch(self.lifecycle.sketch) if self.lifecycle.admit_after > 1 else None
        self.tally = life.Tally()
        self.optimizer = RowOptimizer(optimizer)
        lc = self.lifecycle
        self.index = index_for(spec.rows, lc.bounded or lc.ttl > 0, reserve)
        dtype = getattr(torch, spec.dtype)
        self.values = torch.empty((reserve, spec.dim), dtype=dtype)
        self.state = [
            torch.empty((reserve, width), dtype=kind or dtype)
            for width, kind in optimizer.state_layout(spec.dim)
        ]
        self._swept = 0  # the step of the last TTL sweep
        self.hits = np.zeros(reserve, np.int32)  # pushes applied to the row in each slot
        self.last = np.zeros(reserve, np.int32)  # the step of the last one
        # since the last checkpoint took the changes (``tablestate.take_changes``): the
        # slots written, each slot's id, and the ids evicted
        self.changed = np.zeros(reserve, bool)
        self.slot_ids = np.zeros(reserve, np.int64)
        self.removed: list[np.ndarray] = []

    @property
    def held(self) -> int:
        """Rows held now (created and not evicted)."""
        return len(self.index)

    def nbytes(self) -> int:
        """The bytes the table's storage and index take."""
        arrays = [self.values, *self.state]
        return (
            sum(t.numel() * t.element_size() for t in arrays)
            + self.hits.nbytes
            + self.last.nbytes
            + self.changed.nbytes
            + self.slot_ids.nbytes
            + self.index.nbytes()
            + (self.sketch.counts.nbytes if self.sketch is not None else 0)
        )

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
        bad = (arr < 0) | (arr >= self.spec.rows) if self.spec.rows else np.zeros(0, bool)
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
        # a worker's ids come sorted: strictly increasing is distinct, without a sort
        if not (arr[1:] > arr[:-1]).all() and len(np.unique(arr)) != len(arr):
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

    def prepare(self, ids: np.ndarray) -> Prepared:
        """The initial values of the ids of a push that are not held now, computed before
        the push takes the lock its apply holds (``apply``'s ``prepared``). The index is
        read as a hint: a row created or evicted meanwhile costs a computation under the
        lock, never a wrong value."""
        return prepare_all([(self, ids)])[0]

    def wanted(self, ids: np.ndarray) -> Wanted:
        """What ``initial_values_many`` takes for this table's rows ``ids``."""
        spec = self.spec
        return (self.key, ids, spec.dim, spec.dtype, self.init, not spec.rows)

    def _initial(self, ids: np.ndarray) -> torch.Tensor:
        return initial_values(*self.wanted(ids))

    def _create(self, ids: np.ndarray, prepared: Prepared | None = None) -> np.ndarray:
        """Rows for ``ids`` (distinct, not held) at their initial values (those
        ``prepared`` holds taken from it); their slots."""
        slots = self.index.insert(ids)
        self._reserve(self.index.slots_used)
        at = torch.from_numpy(slots)
        have = np.zeros(len(ids), bool)
        if prepared is not None and np.array_equal(prepared[0], ids):  # as a push's check
            # found them: no row was created or evicted meanwhile
            self.values[at] = prepared[1]
            have[:] = True
        elif prepared is not None and len(prepared[0]):
            pos = np.minimum(np.searchsorted(prepared[0], ids), len(prepared[0]) - 1)
            have = prepared[0][pos] == ids
            self.values[at[torch.from_numpy(have)]] = prepared[1][torch.from_numpy(pos[have])]
        if not have.all():
            self.values[at[torch.from_numpy(~have)]] = self._initial(ids[~have])
        for s in self.state:
            s[at] = self.optimizer.config.initial_state()
        self.hits[slots] = 0
        self.slot_ids[slots] = ids
        self.changed[slots] = True
        self.tally.create(ids)
        return slots

    def _reserve(self, n: int) -> None:
        """Storage for slots [0, n): doubled at a time, so a table of n rows copies its
        rows about once while it grows. The pages past the rows held are never touched
        (``torch.empty``, zeros from ``calloc``), so they cost address space, not memory."""
        if n <= len(self.values):
            return
        size = max(n, 2 * len(self.values))

        def grown(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty((size, t.shape[1]), dtype=t.dtype)
            out[: len(t)] = t
            return out

        self.values = grown(self.values)
        self.state = [grown(s) for s in self.state]
        self.hits = _grown_counts(self.hits, size)
        self.last = _grown_counts(self.last, size)
        self.changed = _grown_counts(self.changed, size)
        self.slot_ids = _grown_counts(self.slot_ids, size)

    def _evict(self, count: int, spared_ids: np.ndarray, step: int, ttl: bool) -> None:
        """Evict ``count`` rows by the lifecycle's policy (``ttl``: those past their TTL at
        ``step``), never one of ``spared_ids``."""
        held, slots = self.index.items()
        spared = np.isin(held, spared_ids)
        if ttl:
            gone = life.expired(self.last[slots], spared, step, self.lifecycle.ttl)
        else:
            gone = life.victims(
                held, self.hits[slots], self.last[slots], spared, count, self.lifecycle.evict
            )
        if len(gone):
            self.index.remove(held[gone])
            self.tally.evict(held[gone])
            self.changed[slots[gone]] = False
            self.removed.append(held[gone])

    def tick(self, step: int, spared: np.ndarray | None = None) -> None:
        """The server's ``step`` has come: evict the rows past their TTL if a sweep is due
        (never one of ``spared``, a push's rows), whether or not a push named this table."""
        if self.lifecycle.sweep_due(step, self._swept):
            self._swept = step
            self._evict(0, np.empty(0, np.int64) if spared is None else spared, step, True)

    def pull(self, ids: Any) -> torch.Tensor:
        """The rows ``ids`` (any order, repeats allowed): (len(ids), dim), a copy; the
        initial values of rows not held, none of which is created."""
        return self.lookup(self.check_ids(ids, "A pull")).complete()

    def lookup(self, arr: np.ndarray) -> Lookup:
        """The rows held among ids that ``check_ids`` returned, copied; creates nothing."""
        slots = self.index.find(arr)
        held = slots >= 0
        values = self.values[torch.from_numpy(slots[held])]
        init = None if self.lifecycle.unadmitted == "zeros" else self.init
        spec = self.spec
        return Lookup(
            arr, held, values, self.key, spec.dim, spec.dtype, init, not spec.rows, self.recent
        )

    def push(self, ids: Any, grads: Any, step: int | None = None) -> None:
        """One optimizer step on rows ``ids`` (distinct) with ``grads`` (one row each)."""
        self.apply(*self.check_push(ids, grads), step=step)

    def apply(
        self,
        ids: np.ndarray,
        grads: torch.Tensor,
        lr: float | None = None,
        step: int | None = None,
        prepared: Prepared | None = None,
    ) -> None:
        """``push`` of what ``check_push`` returned (at ``lr``; None: the optimizer's), at
        the server's ``step`` (None: this table's count of steps): the rows not held are
        created (those admitted; the others' gradients are dropped and counted), rows go
        where the capacity or the TTL says so, then the optimizer steps. ``prepared``: the
        initial values ``prepare`` computed before the lock."""
        now = self.optimizer.steps + 1 if step is None else step
        slots = self.index.find(ids)
        new = slots < 0
        if new.any():
            lc = self.lifecycle
            if self.sketch is not None:
                admitted = self.sketch.add(ids[new]) >= lc.admit_after
                if not admitted.all():
                    self.tally.dropped += int((~admitted).sum())
                    keep = ~new
                    keep[np.flatnonzero(new)[admitted]] = True
                    ids, grads, slots = ids[keep], grads[torch.from_numpy(keep)], slots[keep]
                    new = slots < 0
            over = len(self.index) + int(new.sum()) - lc.capacity
            if lc.bounded and over > 0:
                self._evict(len(self.index) - lc.low_water + int(new.sum()), ids, now, False)
                room = max(lc.capacity - len(self.index), 0)
                if int(new.sum()) > room:  # the push alone passes the capacity: its
                    # new rows past it are not created, their gradients dropped and counted
                    keep = np.ones(len(ids), bool)
                    keep[np.flatnonzero(new)[room:]] = False
                    self.tally.dropped += int((~keep).sum())
                    ids, grads, slots = ids[keep], grads[torch.from_numpy(keep)], slots[keep]
                    new = slots < 0
            if new.any():
                slots[new] = self._create(ids[new], prepared)  # may replace the arrays
        self.tick(now, ids)
        if not len(ids):
            self.optimizer.steps += 1
            return
        self.hits[slots] = np.minimum(self.hits[slots].astype(np.int64) + 1, 2**31 - 1)
        self.last[slots] = min(now, 2**31 - 1)
        self.changed[slots] = True
        self.optimizer.step(self.values, self.state, torch.from_numpy(slots), grads, lr)

    def read(self, ids: Any) -> torch.Tensor:
        """The current values of rows ``ids`` without creating any (untouched rows: their
        initial values), for checkpoints and ``model_state_dict``."""
        return self.lookup(self.check_ids(ids, "A read")).complete()

    def load_rows(self, ids: np.ndarray, values: torch.Tensor) -> None:
        """Rows ``ids`` (distinct) set to ``values``, their optimizer state fresh: a whole
        table loaded from a state dict."""
        arr = self.check_ids(ids, "Rows loaded")
        slots = self.index.find(arr)
        new = slots < 0
        if new.any():  # created at the values loaded: no initial values computed
            fresh = arr[new]
            slots[new] = self._create(fresh, (fresh, values[torch.from_numpy(new)]))
        at = torch.from_numpy(slots)
        self.values[at] = values.to(self.values.dtype)
        for s in self.state:
            s[at] = self.optimizer.config.initial_state()
        self.last[slots] = self.optimizer.steps
        self.changed[slots] = True
        over = len(self.index) - self.lifecycle.capacity
        if self.lifecycle.bounded and over > 0:  # rows past the capacity go, as it says
            self._evict(over, np.empty(0, np.int64), self.optimizer.steps, False)

    # saving and restoring: ``tablestate.py``


def prepare_all(pushed: Sequence[tuple[ShardTable, np.ndarray]]) -> list[Prepared]:
    """Each ``table.prepare(ids)``, the initial values of every table's rows computed in
    one pass (``initial_values_many``)."""
    fresh = [np.sort(ids[~table.index.held_hint(ids)]) for table, ids in pushed]
    wanted = [table.wanted(f) for (table, _), f in zip(pushed, fresh, strict=True)]
    recent = next((t.recent for t, _ in pushed if t.recent is not None), None)
    return list(zip(fresh, initial_values_many(wanted, recent, take=True), strict=True))
