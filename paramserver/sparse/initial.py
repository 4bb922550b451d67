"""A table's initial rows as tensors: ``initial_rows`` (``sparse/rows.py``, pure functions
of the seed, the table and the id) computed a bounded chunk at a time, and for the rows of
many tables at once (a Criteo push names 26 tables: one pass of numpy's instead of 26).

``Recent`` keeps the values computed last for each table of a shard, so the push that
follows a worker's row pull takes the initial values of its new rows from the pull instead
of computing them again (issue 44: 1.4 ms of a Criteo push). Being pure functions of the
table's key and the id, a kept value is never stale."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np
import torch

from paramserver.sparse.rows import Init, initial_rows, splitmix64

INITIAL_CHUNK = 1 << 16  # ids whose initial values are computed at once (bounded temporaries)

# The initial values wanted of one table: its key, the ids, its width, dtype, initialiser
# and whether its ids are mixed first (``initial_values``).
Wanted = tuple[np.uint64, np.ndarray, int, str, Init, bool]


# A table's initial values: its key, width, dtype, initialiser and id mixing.
Group = tuple[int, int, str, Init, bool]


class Recent:
    """The initial values computed last: the newest ``blocks`` of each table, at most
    ``budget`` bytes in all (the least recently kept table's oldest block goes first)."""

    def __init__(self, blocks: int = 4, budget: int = 64 << 20):
        self._kept: OrderedDict[Group, deque[tuple[np.ndarray, torch.Tensor]]] = OrderedDict()
        self._blocks, self._budget, self.bytes = blocks, budget, 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0  # rows taken from a block, and computed

    def take(self, group: Group, ids: np.ndarray) -> tuple[np.ndarray, torch.Tensor | None]:
        """Which of ``ids`` a kept block holds (bool each) and their values, in that order
        (None: none held)."""
        with self._lock:
            blocks = list(self._kept.get(group, ()))
        found = np.zeros(len(ids), bool)
        parts: list[tuple[np.ndarray, torch.Tensor]] = []
        for kept, values in reversed(blocks):  # the newest first
            rest = np.flatnonzero(~found)
            if not len(rest):
                break
            pos = np.minimum(np.searchsorted(kept, ids[rest]), len(kept) - 1)
            hit = kept[pos] == ids[rest]
            if hit.any():
                found[rest[hit]] = True
                parts.append((rest[hit], values[torch.from_numpy(pos[hit])]))
        n = int(found.sum())
        with self._lock:
            self.hits, self.misses = self.hits + n, self.misses + len(ids) - n
        if not parts:
            return found, None
        where = np.concatenate([w for w, _ in parts])
        order = torch.from_numpy(np.argsort(where, kind="stable"))
        return found, torch.cat([v for _, v in parts])[order]

    def keep(self, group: Group, ids: np.ndarray, values: torch.Tensor) -> None:
        """Values of ``ids`` (distinct), just computed."""
        size = values.numel() * values.element_size() + ids.nbytes
        if not len(ids) or size > self._budget // 2:
            return
        if len(ids) > 1 and not (ids[1:] > ids[:-1]).all():  # a pull's ids come sorted
            order = np.argsort(ids, kind="stable")
            ids, values = ids[order], values[torch.from_numpy(order)]
        block = (ids.copy(), values.clone())
        with self._lock:
            kept = self._kept.setdefault(group, deque())
            self._kept.move_to_end(group)
            kept.append(block)
            self.bytes += size
            if len(kept) > self._blocks:
                self._drop(group)
            while self.bytes > self._budget:
                self._drop(next(iter(self._kept)))

    def _drop(self, group: Group) -> None:
        """The oldest block of table ``group`` (a table left without one goes)."""
        kept = self._kept[group]
        ids, values = kept.popleft()
        self.bytes -= values.numel() * values.element_size() + ids.nbytes
        if not kept:
            del self._kept[group]


def initial_values_many(
    wanted: Sequence[Wanted], recent: Recent | None = None, take: bool = False
) -> list[torch.Tensor]:
    """``initial_values`` of each entry, those of one width, dtype, initialiser and mixing
    computed together (``initial_rows`` takes a key per id). With ``recent``: ``take``
    (a push's check) those it holds from it, the rest computed; else (a row pull) all
    computed and kept there."""
    if recent is None or not take:
        out = _computed(wanted)
        if recent is not None:
            for w, made in zip(wanted, out, strict=True):
                recent.keep(_group(w), w[1], made)
        return out
    taken = [recent.take(_group(w), w[1]) for w in wanted]
    missing = [np.flatnonzero(~found) for found, _ in taken]
    computed = _computed([(w[0], w[1][m], *w[2:]) for w, m in zip(wanted, missing, strict=True)])
    out = []
    for w, (found, values), m, made in zip(wanted, taken, missing, computed, strict=True):
        if values is None:
            out.append(made)
            continue
        full = torch.empty((len(w[1]), w[2]), dtype=getattr(torch, w[3]))
        full[torch.from_numpy(found)] = values
        full[torch.from_numpy(m)] = made
        out.append(full)
    return out


def _group(w: Wanted) -> Group:
    return (int(w[0]), w[2], w[3], w[4], w[5])


def _computed(wanted: Sequence[Wanted]) -> list[torch.Tensor]:
    """``initial_values`` of each entry, those of one width, dtype, initialiser and mixing
    computed together."""
    out: list[torch.Tensor | None] = [None] * len(wanted)
    groups: dict[tuple[int, str, Init, bool], list[int]] = {}
    for i, (_, _, dim, dtype, init, mix) in enumerate(wanted):
        groups.setdefault((dim, dtype, init, mix), []).append(i)
    for (dim, dtype, init, mix), members in groups.items():
        if len(members) == 1:
            key, ids = wanted[members[0]][:2]
            out[members[0]] = initial_values(key, ids, dim, dtype, init, mix)
            continue
        ids = np.concatenate([wanted[i][1] for i in members])
        keys = np.concatenate(
            [np.full(len(wanted[i][1]), wanted[i][0], np.uint64) for i in members]
        )
        values = initial_values(keys, ids, dim, dtype, init, mix)
        at = 0
        for i in members:
            n = len(wanted[i][1])
            out[i] = values[at : at + n]
            at += n
    return [v for v in out if v is not None]  # every entry is set above


def initial_values(
    key: np.uint64 | np.ndarray,
    ids: np.ndarray,
    dim: int,
    dtype: str,
    init: Init,
    mix: bool = False,
) -> torch.Tensor:
    """``initial_rows`` of ``ids`` as a tensor, computed ``INITIAL_CHUNK`` ids at a time
    (bounded temporaries); ``key``: the table's, or one per id. ``mix`` (an unbounded
    table's ids, any int64): each id hashed first (``splitmix64``, a bijection), since
    ``initial_rows`` counts ``id * dim`` cells, which wrap for ids past 2**64 / dim and
    would repeat other ids' rows."""
    out = torch.empty((len(ids), dim), dtype=getattr(torch, dtype))
    if mix:
        ids = splitmix64(ids.astype(np.uint64)).view(np.int64)
    keys = np.asarray(key, np.uint64)
    for lo in range(0, len(ids), INITIAL_CHUNK):
        part = ids[lo : lo + INITIAL_CHUNK]
        salt = keys[lo : lo + len(part)] if keys.ndim else keys
        out[lo : lo + len(part)] = torch.from_numpy(initial_rows(salt, part, dim, dtype, init))
    return out
