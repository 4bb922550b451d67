"""Row ids to storage slots: a vectorised open-addressing hash table (linear probing), so a
batch of ids is looked up, inserted or removed with a few numpy passes and never a Python
loop per id.

- Any int64 is an id (an unbounded table's ids are production feature ids, negative ones
  too): whether a bucket is empty, full or deleted is kept apart, one byte a bucket.
- Slots are handed out 0, 1, 2, ... in order of first touch; a removed id's slot is given
  to the next id inserted, so storage stays as large as the most rows held at once.
- Removal leaves a tombstone (lookups probe past it, inserts reuse it); the table is
  rebuilt when full and deleted buckets pass ``MAX_LOAD`` of it, to a load of at most
  ``REBUILT_LOAD``: rows evicted and created push after push rebuild it once in a while,
  not at every push.
- ``held_hint`` reads without the lock that guards changes: its arrays are one snapshot,
  and buckets only go empty to full to deleted (to full again) until a rebuild swaps in
  new ones, so it ends and is right for every id not being inserted or removed meanwhile.
- Memory: 13 bytes a bucket (key, int32 slot, state), between 1/``MAX_LOAD`` and
  2/``MAX_LOAD`` buckets a row: 19 to 37 bytes a row.
"""

from __future__ import annotations

import numpy as np

from paramserver.sparse.rows import splitmix64

EMPTY, FULL, DELETED = 0, 1, 2
MAX_LOAD = 0.7
REBUILT_LOAD = 0.6
MAX_SLOTS = (1 << 31) - 1  # slots are int32: rows one index holds at most
# Buckets use another hash than the shard choice: on shard s of S every id has
# splitmix64(id) = s (mod S), so those low bits would crowd a power-of-two table.
_BUCKET_SALT = np.uint64(0x5851F42D4C957F2D)


class Slots:
    """Slots handed out 0, 1, 2, ... in order of first touch, a freed one first: storage
    stays as large as the most rows held at once."""

    _next: int  # slots handed out so far (held or free)
    _free: np.ndarray  # slots of removed ids, reused first

    @property
    def slots_used(self) -> int:
        """Slots handed out so far: storage must hold this many rows."""
        return self._next

    def _hand_out(self, n: int) -> np.ndarray:
        reused = min(n, len(self._free))
        slots = np.empty(n, np.int64)
        slots[:reused] = self._free[len(self._free) - reused :]
        self._free = self._free[: len(self._free) - reused]
        slots[reused:] = np.arange(self._next, self._next + n - reused)
        self._next += n - reused
        return slots


class RowIndex(Slots):
    def __init__(self, capacity: int = 1024):
        self._alloc(_buckets_for(capacity))
        self._snapshot = (self._keys, self._state)  # for held_hint: swapped once whole
        self.size = 0  # ids held
        self._deleted = 0  # tombstones
        self._next = 0  # slots handed out so far (held or free)
        self._free = np.empty(0, np.int64)  # slots of removed ids, reused first

    def _alloc(self, buckets: int) -> None:
        self._keys = np.zeros(buckets, np.int64)
        self._slots = np.zeros(buckets, np.int32)
        self._state = np.zeros(buckets, np.uint8)

    def __len__(self) -> int:
        return self.size

    @property
    def capacity(self) -> int:
        return len(self._keys)

    def nbytes(self) -> int:
        return self._keys.nbytes + self._slots.nbytes + self._state.nbytes + self._free.nbytes

    def _buckets(self, ids: np.ndarray) -> np.ndarray:
        mask = np.uint64(len(self._keys) - 1)
        return (splitmix64(ids.astype(np.uint64) ^ _BUCKET_SALT) & mask).astype(np.int64)

    def _locate(self, ids: np.ndarray) -> np.ndarray:
        """The bucket of each id, or -1 where it is not held."""
        out = np.full(len(ids), -1, np.int64)
        at = self._buckets(ids)
        pending = np.arange(len(ids))
        mask = len(self._keys) - 1
        while pending.size:
            b = at[pending]
            state = self._state[b]
            hit = (state == FULL) & (self._keys[b] == ids[pending])
            out[pending[hit]] = b[hit]
            pending = pending[~hit & (state != EMPTY)]
            at[pending] = (at[pending] + 1) & mask
        return out

    def held_hint(self, ids: np.ndarray) -> np.ndarray:
        """Whether each id is held, read while another thread may change the index (see
        the module's note): a hint, exact for ids no change touches."""
        keys, state = self._snapshot
        ids = np.asarray(ids, np.int64)
        out = np.zeros(len(ids), bool)
        mask = np.uint64(len(keys) - 1)
        at = (splitmix64(ids.astype(np.uint64) ^ _BUCKET_SALT) & mask).astype(np.int64)
        pending = np.arange(len(ids))
        for _ in range(len(keys)):  # at most one lap
            if not pending.size:
                break
            b = at[pending]
            st = state[b]
            hit = (st == FULL) & (keys[b] == ids[pending])
            out[pending[hit]] = True
            pending = pending[~hit & (st != EMPTY)]
            at[pending] = (at[pending] + 1) & int(mask)
        return out

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id (int64), or -1 where the id is not held."""
        ids = np.asarray(ids, np.int64)
        at = self._locate(ids)
        out = np.full(len(ids), -1, np.int64)
        held = at >= 0
        out[held] = self._slots[at[held]]
        return out

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Give each id, distinct and not held, a slot (freed ones first); returns them."""
        ids = np.asarray(ids, np.int64)
        n = len(ids)
        if self.size + n > MAX_SLOTS:
            raise OverflowError(f"One index holds at most {MAX_SLOTS} rows.")
        if self.size + self._deleted + n > MAX_LOAD * len(self._keys):
            self._rebuild(self.size + n)
        slots = self._hand_out(n)
        self._place(ids, slots)
        self.size += n
        return slots

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Forget the ids held among ``ids`` (distinct); returns the slots they freed."""
        at = self._locate(np.asarray(ids, np.int64))
        at = at[at >= 0]
        freed = self._slots[at].astype(np.int64)
        self._state[at] = DELETED
        self.size -= len(at)
        self._deleted += len(at)
        self._free = np.concatenate([self._free, freed])
        return freed

    def _place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        at = self._buckets(ids)
        pending = np.arange(len(ids))
        mask = len(self._keys) - 1
        while pending.size:
            free = pending[self._state[at[pending]] != FULL]
            # of the ids aiming at one free bucket, the first takes it
            _, first = np.unique(at[free], return_index=True)
            won = free[first]
            b = at[won]
            self._deleted -= int((self._state[b] == DELETED).sum())
            self._keys[b] = ids[won]
            self._slots[b] = slots[won]
            self._state[b] = FULL
            left = np.ones(len(ids), bool)
            left[won] = False
            pending = pending[left[pending]]
            at[pending] = (at[pending] + 1) & mask

    def _rebuild(self, needed: int) -> None:
        """New buckets for ``needed`` ids with room to spare (a load of at most
        ``REBUILT_LOAD``), so that ids coming and going do not rebuild it again at once."""
        held = self._state == FULL
        ids, slots = self._keys[held], self._slots[held]
        self._alloc(_buckets_for(int(needed * MAX_LOAD / REBUILT_LOAD) + 1))
        self._deleted = 0
        self._place(ids, slots)
        self._snapshot = (self._keys, self._state)  # filled first, then seen

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (id, slot) held, ordered by slot."""
        held = self._state == FULL
        ids, slots = self._keys[held], self._slots[held].astype(np.int64)
        order = np.argsort(slots, kind="stable")
        return ids[order], slots[order]


# A table of at most this many declared rows, without a capacity or a TTL, indexes its rows
# by id directly (``DirectIndex``): 4 bytes of address space a declared row (64 MiB at
# most), of which only the pages its ids touch take memory.
DIRECT_ROWS = 1 << 24


class DirectIndex(Slots):
    """``RowIndex``'s interface for ids in [0, rows): a slot array indexed by id (slot + 1;
    0: not held), so a batch of ids is one gather. Allocated zeroed (``calloc``: the kernel
    maps a page once an id on it is written). ``held_hint`` reads it unlocked: an entry goes
    0 to a slot and back as one int32 store, and the array is never replaced.

    Slots are handed out as ``RowIndex`` hands them (in order, freed ones first); ``items``
    scans the ids' range (a checkpoint's, a few ms for 10M rows), which is why tables with
    a capacity or a TTL (that evict every push) keep the hashed index."""

    def __init__(self, rows: int):
        self._slot = np.zeros(rows, np.int32)
        self.size = 0
        self._next = 0
        self._free = np.empty(0, np.int64)

    def __len__(self) -> int:
        return self.size

    def nbytes(self) -> int:
        return self._slot.nbytes + self._free.nbytes

    def held_hint(self, ids: np.ndarray) -> np.ndarray:
        return self._slot[np.asarray(ids, np.int64)] > 0

    def find(self, ids: np.ndarray) -> np.ndarray:
        return self._slot[np.asarray(ids, np.int64)].astype(np.int64) - 1

    def insert(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        n = len(ids)
        slots = self._hand_out(n)
        self._slot[ids] = slots + 1
        self.size += n
        return slots

    def remove(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        at = self._slot[ids]
        held = at > 0
        freed = at[held].astype(np.int64) - 1
        self._slot[ids[held]] = 0
        self.size -= len(freed)
        self._free = np.concatenate([self._free, freed])
        return freed

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        ids = np.flatnonzero(self._slot)
        slots = self._slot[ids].astype(np.int64) - 1
        order = np.argsort(slots, kind="stable")
        return ids[order], slots[order]


def index_for(rows: int, bounded: bool, reserve: int = 1024) -> RowIndex | DirectIndex:
    """The index of a table of ``rows`` declared rows (0: unbounded), ``bounded`` when a
    capacity or a TTL evicts its rows: by id directly up to ``DIRECT_ROWS`` rows, else
    hashed."""
    if 0 < rows <= DIRECT_ROWS and not bounded:
        return DirectIndex(rows)
    return RowIndex(reserve)


def _buckets_for(rows: int) -> int:
    """A power of two of buckets that holds ``rows`` under ``MAX_LOAD``."""
    need = max(16, int(np.ceil(max(rows, 1) / MAX_LOAD)) + 1)
    return 1 << (need - 1).bit_length()
