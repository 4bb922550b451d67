"""A table's row lifecycle on one shard: which ids get a row, and which rows go. Decisions
only: ``table.ShardTable`` holds the rows and asks these.

- **Admission** (``admit_after`` K): a row is created and trained only once a push has
  named its id K times. Until then its gradient is dropped (counted) and a lookup answers
  the table's initial value (``unadmitted`` "init") or zeros. The sightings are counted in
  a count-min sketch (``Sketch``: two hashes into ``sketch`` one-byte counters, about 1 MiB
  a table and shard), so ids never admitted cost no memory of their own; a collision can
  only admit an id early, never late (Monolith's and DeepRec's filters do the same). The
  counters stop at 255, so K is at most ``MAX_ADMIT``.
- **Capacity** (rows a shard holds at most) with ``evict`` "lru" (least recently pushed
  first) or "lfu" (fewest pushes first, then least recent). A push that would pass the
  capacity first evicts down to ``low_water`` (15/16 of it), never a row of that push, so
  one scan of the rows serves a sixteenth of the capacity in new rows. Ties go to the
  smaller id, so the rows kept do not depend on where rows sit in storage (a restored
  checkpoint evicts as the run it came from would have). The capacity is a
  hard bound: a push with more new rows than there is room for once every other row is
  gone creates only as many as fit (the rest of its gradients dropped and counted).
- **TTL** (steps): a row not pushed for more than ``ttl`` of the server's steps goes, at a
  sweep once ``ttl // 4`` steps have passed since the last one (so at most ``1.25 * ttl``
  after its last push), whether or not a push names the table then.
- **Counters** per row: pushes (``hits``) and the last step pushed; per table: admitted,
  evicted, dropped gradient rows, and rows reborn (created again after their eviction, as a
  push computed on the row before it was evicted makes; estimated with a bitset of evicted
  ids, which may count a collision too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from paramserver.errors import ConfigError
from paramserver.sparse.rows import splitmix64

POLICIES = ("lru", "lfu")
MAX_ADMIT = 255  # the sketch's one-byte counters count this far
UNADMITTED = ("init", "zeros")
_SALTS = (np.uint64(0xA0761D6478BD642F), np.uint64(0xE7037ED1A0B428DB))


@dataclass(frozen=True)
class Lifecycle:
    """One table's lifecycle settings; the defaults keep every row for ever."""

    admit_after: int = 1  # pushes naming an id before its row is created (1: the first)
    capacity: int = 0  # rows a shard holds at most (0: no limit)
    evict: str = "lru"  # which rows go first at capacity: "lru" or "lfu"
    ttl: int = 0  # steps without a push after which a row goes (0: never)
    unadmitted: str = "init"  # a row not held reads as its initial value, or "zeros"
    sketch: int = 1 << 20  # counters of the admission sketch

    def checked(self, table: str) -> Lifecycle:
        """Itself, or ConfigError naming the table, the setting and its value."""
        limits = {"admit_after": (1, MAX_ADMIT), "capacity": (0, None), "ttl": (0, None)}
        limits["sketch"] = (1024, None)
        for name, (lowest, highest) in limits.items():
            value = getattr(self, name)
            whole = isinstance(value, int | np.integer) and not isinstance(value, bool)
            if not whole or value < lowest or (highest is not None and value > highest):
                within = f">= {lowest}" if highest is None else f"in [{lowest}, {highest}]"
                raise ConfigError(
                    f"Table {table!r}: {name} must be an integer {within}; got {value!r}."
                )
        if self.evict not in POLICIES:
            raise ConfigError(
                f"Table {table!r}: evict is one of {', '.join(POLICIES)}; got {self.evict!r}."
            )
        if self.unadmitted not in UNADMITTED:
            raise ConfigError(
                f"Table {table!r}: unadmitted is one of {', '.join(UNADMITTED)}; got "
                f"{self.unadmitted!r}."
            )
        return self

    @property
    def bounded(self) -> bool:
        return self.capacity > 0

    @property
    def low_water(self) -> int:
        """Rows held after an eviction at capacity."""
        return self.capacity - max(1, self.capacity // 16)

    def sweep_due(self, step: int, last_sweep: int) -> bool:
        """Whether the TTL sweep runs at ``step``, the last one having run at ``last_sweep``."""
        return self.ttl > 0 and step - last_sweep >= max(1, self.ttl // 4)


class Sketch:
    """Count-min counts of the ids pushed before their admission: ``add`` counts one
    sighting of each id (distinct) and answers the counts after it (at most 255)."""

    def __init__(self, width: int):
        self.counts = np.zeros(width, np.uint8)

    def _cells(self, ids: np.ndarray) -> list[np.ndarray]:
        width = np.uint64(len(self.counts))
        u = ids.astype(np.uint64)
        return [(splitmix64(u ^ salt) % width).astype(np.int64) for salt in _SALTS]

    def add(self, ids: np.ndarray) -> np.ndarray:
        cells = self._cells(ids)
        for c in cells:
            where, bumped = np.unique(c, return_counts=True)
            total = self.counts[where].astype(np.int64) + bumped
            self.counts[where] = np.minimum(total, 255).astype(np.uint8)
        return np.minimum(*(self.counts[c] for c in cells)).astype(np.int64)


@dataclass
class Tally:
    """A table's lifecycle counters on one shard."""

    admitted: int = 0
    evicted: int = 0
    dropped: int = 0
    reborn: int = 0
    evicted_ids: np.ndarray = field(default_factory=lambda: np.zeros(1 << 16, bool))

    def _cells(self, ids: np.ndarray) -> np.ndarray:
        width = np.uint64(len(self.evicted_ids))
        return (splitmix64(ids.astype(np.uint64) ^ _SALTS[0]) % width).astype(np.int64)

    def evict(self, ids: np.ndarray) -> None:
        self.evicted += len(ids)
        self.evicted_ids[self._cells(ids)] = True

    def create(self, ids: np.ndarray) -> None:
        self.admitted += len(ids)
        if self.evicted:
            cells = self._cells(ids)
            self.reborn += int(self.evicted_ids[cells].sum())
            self.evicted_ids[cells] = False

    def state(self) -> dict[str, int]:
        """The counters (what status reports)."""
        return {
            "admitted": self.admitted,
            "evicted": self.evicted,
            "dropped": self.dropped,
            "reborn": self.reborn,
        }

    def saved(self) -> dict[str, Any]:
        """The counters and the bitset of evicted ids, for a checkpoint (tensors and plain
        values: what ``torch.load(weights_only=True)`` reads)."""
        return {**self.state(), "evicted_ids": torch.from_numpy(np.packbits(self.evicted_ids))}

    def load(self, saved: dict[str, Any]) -> None:
        for name in ("admitted", "evicted", "dropped", "reborn"):
            setattr(self, name, int(saved.get(name, 0)))
        bits = saved.get("evicted_ids")
        if bits is not None and len(bits) * 8 == len(self.evicted_ids):
            self.evicted_ids = np.unpackbits(torch.as_tensor(bits).numpy()).astype(bool)


def victims(
    ids: np.ndarray,
    hits: np.ndarray,
    last: np.ndarray,
    spared: np.ndarray,
    n: int,
    policy: str,
) -> np.ndarray:
    """Positions of the ``n`` rows to evict first under ``policy`` among rows ``ids`` with
    counters ``hits`` and ``last``, never one where ``spared`` (all of them when fewer can
    go); ties go to the smaller id."""
    candidates = np.flatnonzero(~spared)
    if n >= len(candidates):
        return candidates
    key = last[candidates].astype(np.int64)  # int32 steps: below 2**31
    if policy == "lfu":  # fewest pushes, then least recent
        key += hits[candidates].astype(np.int64) << 31
    cut = np.partition(key, n - 1)[n - 1]
    below = candidates[key < cut]
    tied = candidates[key == cut]
    tied = tied[np.argsort(ids[tied], kind="stable")[: n - len(below)]]
    return np.concatenate([below, tied])


def expired(last: np.ndarray, spared: np.ndarray, step: int, ttl: int) -> np.ndarray:
    """Positions of the rows not pushed for more than ``ttl`` steps at ``step``."""
    return np.flatnonzero((last < step - ttl) & ~spared)
