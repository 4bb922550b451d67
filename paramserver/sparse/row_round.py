"""The row gradients of the sync round in progress (``RowRound``): summed per table and id,
and at the round's end divided by the ``n`` non-empty pushes, as the dense part is
(``server/bookkeeping/sync_round.py``), so sync stays large-batch SGD for the tables too.
Summed in float64, as the dense part is: the same mean whatever order the pushes came in."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from paramserver.codec.rows import RowGradients
from paramserver.sparse.tableset import Checked


class RowRound:
    """The row gradients of the sync round in progress, summed per table."""

    def __init__(self) -> None:
        self._parts: dict[str, list[RowGradients]] = {}

    def add(self, checked: Iterable[RowGradients]) -> None:
        for push in checked:
            self._parts.setdefault(push.table, []).append(push)

    def take_mean(self, n: int) -> list[RowGradients]:
        """Per table, each touched id's gradient summed over the round and divided by ``n``
        (the round's non-empty pushes); starts the next round."""
        parts, self._parts = self._parts, {}
        return [_coalesce(table, pushes, n) for table, pushes in sorted(parts.items())]

    def state(self) -> dict[str, Any]:
        return {
            table: [(torch.from_numpy(p.ids.copy()), p.grads.clone()) for p in pushes]
            for table, pushes in self._parts.items()
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RowRound:
        r = cls()
        for table, pushes in state.items():
            r._parts[table] = [RowGradients(table, ids.numpy(), grads) for ids, grads in pushes]
        return r


def _coalesce(table: str, pushes: list[RowGradients], n: int) -> RowGradients:
    ids = np.concatenate([p.ids for p in pushes])
    unique, inverse = np.unique(ids, return_inverse=True)
    first = pushes[0].grads
    # summed in float64, as the dense part is (``sync_round.py``): the same sum whatever
    # order the round's pushes came in
    wide = torch.float64 if first.element_size() < 8 else first.dtype
    total = torch.zeros((len(unique), first.shape[1]), dtype=wide)
    grads = torch.cat([p.grads for p in pushes]).to(wide)
    total.index_add_(0, torch.from_numpy(inverse.reshape(-1)), grads)
    ready = [p.prepared for p in pushes if isinstance(p, Checked) and p.prepared is not None]
    prepared = None
    if ready:
        fresh, first_at = np.unique(np.concatenate([i for i, _ in ready]), return_index=True)
        prepared = (fresh, torch.cat([v for _, v in ready])[torch.from_numpy(first_at)])
    return Checked(table, unique, (total / n).to(first.dtype), prepared)
