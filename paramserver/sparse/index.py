"""Row ids to storage slots: a vectorised open-addressing hash table (linear probing, at
most half full), so a batch of ids is looked up or inserted with a few numpy passes and
never a Python loop per id. Slots are handed out 0, 1, 2, ... in order of first touch."""

from __future__ import annotations

import numpy as np

from paramserver.sparse.rows import splitmix64

EMPTY = -1
# Buckets use another hash than the shard choice: on shard s of S every id has
# splitmix64(id) = s (mod S), so those low bits would crowd a power-of-two table.
_BUCKET_SALT = np.uint64(0x5851F42D4C957F2D)


class RowIndex:
    def __init__(self, capacity: int = 1024):
        self._keys = np.full(_power_of_two(capacity), EMPTY, np.int64)
        self._slots = np.empty(len(self._keys), np.int64)
        self.size = 0

    def __len__(self) -> int:
        return self.size

    @property
    def capacity(self) -> int:
        return len(self._keys)

    def _buckets(self, ids: np.ndarray) -> np.ndarray:
        mask = np.uint64(len(self._keys) - 1)
        return (splitmix64(ids.astype(np.uint64) ^ _BUCKET_SALT) & mask).astype(np.int64)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id (int64), or -1 where the id was never inserted."""
        ids = np.asarray(ids, np.int64)
        out = np.full(len(ids), EMPTY, np.int64)
        at = self._buckets(ids)
        pending = np.arange(len(ids))
        mask = len(self._keys) - 1
        while pending.size:
            keys = self._keys[at[pending]]
            hit = keys == ids[pending]
            out[pending[hit]] = self._slots[at[pending[hit]]]
            pending = pending[~hit & (keys != EMPTY)]
            at[pending] = (at[pending] + 1) & mask
        return out

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Give each id, distinct and not present, the next slot; returns them."""
        ids = np.asarray(ids, np.int64)
        if 2 * (self.size + len(ids)) > len(self._keys):
            self._grow(self.size + len(ids))
        slots = np.arange(self.size, self.size + len(ids), dtype=np.int64)
        self._place(ids, slots)
        self.size += len(ids)
        return slots

    def _place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        at = self._buckets(ids)
        pending = np.arange(len(ids))
        mask = len(self._keys) - 1
        while pending.size:
            free = pending[self._keys[at[pending]] == EMPTY]
            # of the ids aiming at one free bucket, the first takes it
            _, first = np.unique(at[free], return_index=True)
            won = free[first]
            self._keys[at[won]] = ids[won]
            self._slots[at[won]] = slots[won]
            left = np.ones(len(ids), bool)
            left[won] = False
            pending = pending[left[pending]]
            at[pending] = (at[pending] + 1) & mask

    def _grow(self, needed: int) -> None:
        held = self._keys != EMPTY
        ids, slots = self._keys[held], self._slots[held]
        self._keys = np.full(_power_of_two(2 * needed), EMPTY, np.int64)
        self._slots = np.empty(len(self._keys), np.int64)
        self._place(ids, slots)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (id, slot), ordered by slot."""
        held = self._keys != EMPTY
        ids, slots = self._keys[held], self._slots[held]
        order = np.argsort(slots, kind="stable")
        return ids[order], slots[order]


def _power_of_two(n: int) -> int:
    return 1 << max(4, (max(n, 1) - 1).bit_length())
