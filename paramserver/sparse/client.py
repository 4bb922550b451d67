"""How a worker reaches the rows of its tables: ``Tables``, pull and push by id, routed to
the shard that holds each row (``rows.shard_of``), one request per shard.

``LocalTables`` holds the shards in this process (``ShardTable``s): the reference the
worker's side is tested against, and what a gRPC client will stand in for. Counters:
rows pulled and pushed, and requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from paramserver.codec.rows import TableSpec
from paramserver.sparse.rows import shard_of
from paramserver.sparse.table import ShardTable


class Tables(Protocol):
    def spec(self, table: str) -> TableSpec: ...

    def pull(self, table: str, ids: np.ndarray) -> torch.Tensor:
        """Rows ``ids`` (distinct) of ``table``: (len(ids), dim)."""
        ...

    def pull_many(self, wanted: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """``pull`` of several tables at once."""
        ...

    def push(self, table: str, ids: np.ndarray, grads: torch.Tensor) -> None:
        """One optimizer step on rows ``ids`` (distinct) with ``grads`` (one row each)."""
        ...


@dataclass
class Traffic:
    rows_pulled: int = 0
    rows_pushed: int = 0
    requests: int = 0


def split_by_shard(ids: np.ndarray, shards: int) -> list[np.ndarray]:
    """The positions in ``ids`` of each shard's rows, shard 0 first."""
    if shards == 1:
        return [np.arange(len(ids))]
    owner = shard_of(ids, shards)
    return [np.flatnonzero(owner == s) for s in range(shards)]


class LocalTables:
    """Every shard of every table in this process: ``shards[name][i]`` holds shard i."""

    def __init__(self, shards: dict[str, Sequence[ShardTable]]):
        self.shards = shards
        self.traffic = Traffic()

    def spec(self, table: str) -> TableSpec:
        if table not in self.shards:
            raise ValueError(
                f"No table {table!r} is served here (tables: "
                f"{', '.join(sorted(self.shards)) or 'none'})."
            )
        return self.shards[table][0].spec

    def pull(self, table: str, ids: np.ndarray) -> torch.Tensor:
        parts = self.shards[table]
        out = torch.empty((len(ids), parts[0].spec.dim), dtype=parts[0].values.dtype)
        for shard, where in zip(parts, split_by_shard(ids, len(parts)), strict=True):
            if len(where):
                out[torch.from_numpy(where)] = shard.pull(ids[where])
                self.traffic.requests += 1
        self.traffic.rows_pulled += len(ids)
        return out

    def pull_many(self, wanted: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {table: self.pull(table, ids) for table, ids in wanted.items()}

    def push(self, table: str, ids: np.ndarray, grads: torch.Tensor) -> None:
        parts = self.shards[table]
        for shard, where in zip(parts, split_by_shard(ids, len(parts)), strict=True):
            if len(where):
                shard.push(ids[where], grads[torch.from_numpy(where)])
                self.traffic.requests += 1
        self.traffic.rows_pushed += len(ids)
