"""A model served from a snapshot (``snapshot.py``), no server running: ``load(path)``.

Every file is checked against the manifest first (its size and SHA-256, read a MiB at a
time): a missing, truncated or changed file is refused with a sentence naming it, and
nothing is served. The dense part loads into the model (``strict``); each sparse table (a
declared ``paramserver.sparse.Embedding``, or an ``nn.Embedding``/``EmbeddingBag`` the run
held as a table) becomes a ``ServedTable`` that reads its rows from the snapshot's files,
mapped: a lookup binary-searches the sorted ids of the shard that holds each id and reads
only those rows' pages, so a snapshot larger than memory serves. Ids the run never
created answer the table's initial values, as the servers would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from paramserver import models
from paramserver.errors import ConfigError
from paramserver.serving.snapshot import FORMAT, MANIFEST, sha256
from paramserver.sparse.declared import distinct_ids, lookup
from paramserver.sparse.embedding import make_tables, replace_tables
from paramserver.sparse.rows import Init, shard_of
from paramserver.sparse.table import initial_values


class ServedTable(nn.Module):
    """One table's rows from a snapshot: read-only, mapped."""

    def __init__(self, name: str, meta: dict[str, Any], root: Path, bag: str | None):
        super().__init__()
        self.table, self.bag = name, bag
        self.dim, self.dtype = int(meta["dim"]), str(meta["dtype"])
        self.key, self.init = np.uint64(int(meta["key"])), Init.parse(meta.get("init", "normal"))
        self.unbounded = not meta["rows"]
        self.shards = [
            (
                np.load(root / s["ids"]["file"], mmap_mode="r"),
                np.load(root / s["values"]["file"], mmap_mode="r"),
            )
            for s in meta["shards"]
        ]

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        """The rows of ``ids`` (distinct int64): (len(ids), dim)."""
        out = torch.empty((len(ids), self.dim), dtype=getattr(torch, self.dtype))
        owner = shard_of(ids, len(self.shards))
        missing = np.zeros(len(ids), bool)
        for i, (held, values) in enumerate(self.shards):
            at = np.flatnonzero(owner == i)
            if not len(at):
                continue
            pos = np.minimum(np.searchsorted(held, ids[at]), max(len(held) - 1, 0))
            found = held[pos] == ids[at] if len(held) else np.zeros(len(at), bool)
            out[torch.from_numpy(at[found])] = torch.from_numpy(np.asarray(values[pos[found]]))
            missing[at[~found]] = True
        if missing.any():
            where = np.flatnonzero(missing)
            out[torch.from_numpy(where)] = initial_values(
                self.key, ids[where], self.dim, self.dtype, self.init, self.unbounded
            )
        return out

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        distinct, inverse = distinct_ids(ids, self.table)
        rows = self.rows(distinct).to(ids.device)
        return lookup(rows, inverse, self.bag, offsets, per_sample_weights)


def read_manifest(path: str | Path, verify: bool = True) -> tuple[Path, dict[str, Any]]:
    """The snapshot folder and its manifest, every file checked (``verify``).

    Raises:
        ConfigError: no snapshot there, or a file missing, truncated or changed.
    """
    root = Path(path)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{root / MANIFEST} is not a snapshot's manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"{root / MANIFEST} is not a paramserver snapshot ({FORMAT}).")
    entries = [manifest["dense"]] + [
        e for t in manifest["tables"].values() for s in t["shards"] for e in (s["ids"], s["values"])
    ]
    for entry in entries if verify else ():
        file = root / entry["file"]
        if not file.is_file():
            raise ConfigError(f"The snapshot's file {file} is missing.")
        if file.stat().st_size != entry["bytes"]:
            raise ConfigError(
                f"The snapshot's file {file} holds {file.stat().st_size} bytes, not the "
                f"{entry['bytes']} its manifest says (truncated or replaced)."
            )
        if sha256(file) != entry["sha256"]:
            raise ConfigError(f"The snapshot's file {file} does not match its manifest's checksum.")
    return root, manifest


def load(path: str | Path, model: nn.Module | None = None, verify: bool = True) -> nn.Module:
    """The model of the snapshot in ``path``, in eval mode, its tables served from the
    snapshot's files (``model``: the run's model to load into; default: the manifest's
    model built with its seed).

    Raises:
        ConfigError: not a snapshot, a file missing or changed, or another model's.
    """
    root, manifest = read_manifest(path, verify)
    built = model if model is not None else models.build(manifest["model"], seed=manifest["seed"])
    make_tables(built, names=manifest["tables"])  # the run's tables, dense as built or not
    tables = manifest["tables"]

    def served(name: str, m: Any, bag: str | None) -> ServedTable:
        if name not in tables:
            raise ValueError(f"the model's table {name!r} is not in the snapshot")
        return ServedTable(name, tables[name], root, bag)

    try:
        replace_tables(built, served)
        dense = torch.load(root / manifest["dense"]["file"], map_location="cpu", weights_only=True)
        built.load_state_dict(dense, strict=True)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"The snapshot in {root} does not load into its model {manifest['model']!r}: {exc}"
        ) from None
    return built.eval()
