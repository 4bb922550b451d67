"""A model served from a snapshot (``snapshot.py``), no server running: ``load(path)``.

Every file is checked against the manifest first (its size and SHA-256, read a MiB at a
time): a missing, truncated or changed file is refused with a sentence naming it, and
nothing is served. Deltas apply in order (``layers.check_chain``): a newer layer's rows
and evictions win over an older one's. The dense part loads into the model (``strict``); each sparse table (a
declared ``paramserver.sparse.Embedding``, or an ``nn.Embedding``/``EmbeddingBag`` the run
held as a table) becomes a ``ServedTable`` that reads its rows from the snapshot's files,
mapped: a lookup binary-searches the sorted ids of the shard that holds each id and reads
only those rows' pages, so a snapshot larger than memory serves. Ids the run never
created answer the table's initial values, as the servers would.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from paramserver import models
from paramserver.errors import ConfigError
from paramserver.serving.layers import Layer, ShardRows, check_chain, read_manifest
from paramserver.sparse.declared import RowLookup
from paramserver.sparse.embedding import make_tables, replace_tables
from paramserver.sparse.initial import initial_values
from paramserver.sparse.rows import Init, shard_of


class ServedTable(RowLookup):
    """One table's rows from a chain of snapshots: read-only, mapped."""

    def __init__(self, name: str, chain: list[tuple[Path, dict[str, Any]]], bag: str | None):
        super().__init__()
        meta = chain[-1][1]["tables"][name]
        self.table, self.bag = name, bag
        self.dim, self.dtype = int(meta["dim"]), str(meta["dtype"])
        self.key, self.init = np.uint64(int(meta["key"])), Init.parse(meta.get("init", "normal"))
        self.unbounded = not meta["rows"]
        self.shards = [
            ShardRows(
                [Layer.open(root, m["tables"][name]["shards"][i]) for root, m in chain],
                self.dim,
                self.dtype,
            )
            for i in range(len(meta["shards"]))
        ]

    def read(self, ids: np.ndarray) -> torch.Tensor:
        """The rows of ``ids`` (distinct int64): (len(ids), dim); those the snapshots do not
        hold (never created, or evicted) at their initial values."""
        out = torch.empty((len(ids), self.dim), dtype=getattr(torch, self.dtype))
        owner = shard_of(ids, len(self.shards))
        missing = np.zeros(len(ids), bool)
        for i, shard in enumerate(self.shards):
            at = np.flatnonzero(owner == i)
            if not len(at):
                continue
            held, found = shard.resolve(ids[at])
            out[torch.from_numpy(at[found])] = torch.from_numpy(held[found])
            missing[at[~found]] = True
        if missing.any():
            where = np.flatnonzero(missing)
            out[torch.from_numpy(where)] = initial_values(
                self.key, ids[where], self.dim, self.dtype, self.init, self.unbounded
            )
        return out

    @property
    def name(self) -> str:
        return self.table

    def rows_of(self, distinct: np.ndarray, device: torch.device) -> torch.Tensor:
        return self.read(distinct).to(device)


def load(
    path: str | Path,
    deltas: Sequence[str | Path] = (),
    model: nn.Module | None = None,
    verify: bool = True,
) -> nn.Module:
    """The model of the snapshot in ``path`` and its ``deltas`` applied in order, in eval
    mode, its tables served from the snapshots' files (``model``: the run's model to load
    into; default: the manifest's model built with its seed). Every file is checked against
    its manifest (``verify``), and the chain must follow: each delta of the one before it.

    Raises:
        ConfigError: not a snapshot, a file missing or changed, a delta out of place (a
            gap, a foreign base), or another model's.
    """
    chain = [read_manifest(p, verify) for p in (path, *deltas)]
    check_chain(chain)
    root, manifest = chain[-1]
    built = model if model is not None else models.build(manifest["model"], seed=manifest["seed"])
    make_tables(built, names=manifest["tables"])  # the run's tables, dense as built or not
    tables = manifest["tables"]

    def served(name: str, m: Any, bag: str | None) -> ServedTable:
        if name not in tables:
            raise ValueError(f"the model's table {name!r} is not in the snapshot")
        return ServedTable(name, chain, bag)

    into = (
        f"the model given ({type(model).__name__})"
        if model is not None
        else f"its model {manifest['model']!r}"
    )
    refusal = f"The snapshot in {root} (of model {manifest['model']!r}) does not load into {into}"
    try:
        replace_tables(built, served)
    except ValueError as exc:
        raise ConfigError(f"{refusal}: {exc}.") from None
    path = root / manifest["dense"]["file"]
    try:
        dense = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unverified (verify=False) and torn: one line
        raise ConfigError(f"{refusal}: cannot read {path}: {type(exc).__name__}: {exc}") from None
    differs = models.state_difference(built, dense)
    if differs:
        raise ConfigError(f"{refusal}: {differs}.")
    built.load_state_dict(dense, strict=True)
    return built.eval()
