"""A chain of snapshots read as one: a full snapshot, then deltas (each the rows changed and
the ids evicted since the one before it). Decisions on arrays only, no files written.

- ``read_manifest``: a snapshot folder's manifest, every file checked against it;
- ``check_chain``: the snapshots follow each other (each delta names its base's manifest
  by SHA-256 and version), or a sentence naming the first that does not;
- ``ShardRows``: one table's rows on one shard across the chain, newest layer first: an id
  a newer layer evicted reads as never created, whatever an older one held.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paramserver.errors import ConfigError

FORMAT = "paramserver-snapshot-v1"
MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    """The file's SHA-256, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


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
        e
        for t in manifest["tables"].values()
        for s in t["shards"]
        for e in (s["ids"], s["values"], s.get("evicted"))
        if e is not None
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


def check_chain(chain: list[tuple[Path, dict[str, Any]]]) -> None:
    """A full snapshot, then deltas each based on the one before it, all of one model,
    shard count and tables.

    Raises:
        ConfigError: a sentence naming the first snapshot out of place.
    """
    (first, head), rest = chain[0], chain[1:]
    if head.get("base"):
        raise ConfigError(
            f"{first} is a delta (of version {head['base']['version']}): a chain starts "
            "with a full snapshot."
        )
    before, prev = first, head
    for root, manifest in rest:
        base = manifest.get("base")
        if not base:
            raise ConfigError(f"{root} is a full snapshot, not a delta of {before}.")
        if base["manifest_sha256"] != sha256(before / MANIFEST):
            raise ConfigError(
                f"{root} is a delta of version {base['version']} of another snapshot, not of "
                f"{before} (version {prev['version']}): a gap, or a foreign base."
            )
        same = ("model", "shards")
        if any(manifest[k] != prev[k] for k in same) or _shapes(manifest) != _shapes(prev):
            raise ConfigError(f"{root} is not of {before}'s model, shard count and tables.")
        before, prev = root, manifest


def _shapes(manifest: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    return {n: (t["rows"], t["dim"], t["dtype"]) for n, t in manifest["tables"].items()}


@dataclass(frozen=True)
class Layer:
    """One snapshot's rows of one table's shard: sorted ids, their values, and (a delta) the
    sorted ids it evicted."""

    ids: np.ndarray
    values: np.ndarray
    evicted: np.ndarray

    @classmethod
    def open(cls, root: Path, shard: dict[str, Any]) -> Layer:
        evicted = shard.get("evicted")
        return cls(
            np.load(root / shard["ids"]["file"], mmap_mode="r"),
            np.load(root / shard["values"]["file"], mmap_mode="r"),
            np.load(root / evicted["file"]) if evicted else np.empty(0, np.int64),
        )


def _find(sorted_ids: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions of ``ids`` in ``sorted_ids`` and whether each is there."""
    if not len(sorted_ids):
        return np.zeros(len(ids), np.int64), np.zeros(len(ids), bool)
    pos = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
    return pos, sorted_ids[pos] == ids


class ShardRows:
    """One table's rows on one shard across a chain of layers (oldest first)."""

    def __init__(self, layers: list[Layer], dim: int, dtype: str):
        self.layers, self.dim, self.dtype = layers, dim, dtype

    def resolve(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of ``ids`` the chain holds, (len(ids), dim), and which it holds (the
        others: never created, or evicted since)."""
        out = np.zeros((len(ids), self.dim), self.dtype)
        found = np.zeros(len(ids), bool)
        pending = np.arange(len(ids))
        for layer in reversed(self.layers):
            if not len(pending):
                break
            pos, here = _find(layer.ids, ids[pending])
            out[pending[here]] = layer.values[pos[here]]
            found[pending[here]] = True
            _, gone = _find(layer.evicted, ids[pending])
            pending = pending[~here & ~gone]
        return out, found

    def held(self) -> np.ndarray:
        """The ids the chain holds (sorted)."""
        ids = np.asarray(self.layers[0].ids)
        for layer in self.layers[1:]:
            ids = np.union1d(np.setdiff1d(ids, layer.evicted), layer.ids)
        return ids
