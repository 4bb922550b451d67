"""A table's initial rows as tensors: ``initial_rows`` (``sparse/rows.py``, pure functions
of the seed, the table and the id) computed a bounded chunk at a time, and for the rows of
many tables at once (a Criteo push names 26 tables: one pass of numpy's instead of 26)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from paramserver.sparse.rows import Init, initial_rows, splitmix64

INITIAL_CHUNK = 1 << 16  # ids whose initial values are computed at once (bounded temporaries)

# The initial values wanted of one table: its key, the ids, its width, dtype, initialiser
# and whether its ids are mixed first (``initial_values``).
Wanted = tuple[np.uint64, np.ndarray, int, str, Init, bool]


def initial_values_many(wanted: Sequence[Wanted]) -> list[torch.Tensor]:
    """``initial_values`` of each entry, those of one width, dtype, initialiser and mixing
    computed together (``initial_rows`` takes a key per id)."""
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
