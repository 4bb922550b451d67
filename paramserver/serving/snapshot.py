"""A serving snapshot of a run, written from its servers' checkpoints (``paramserver export
--snapshot DIR``): what a serving process loads with no server running.

Layout of DIR:

- ``manifest.json``: format, model, seed, version, shard count, which checkpoints it was
  made from, the dense file, and per table its rows (0: unbounded), dim, dtype,
  initialiser, key and its shards' files; every file with its size and SHA-256;
- ``dense.pt``: the model's parameters and buffers, its sparse tables left out;
- ``tables/NAME/I.ids.npy`` and ``I.values.npy``: shard I's rows of table NAME, ids sorted,
  their values in the same order (``.npy``: a loader maps them, reading pages on demand).

Streamed: a shard's checkpoint is mapped, not read, and its rows are written a chunk of
``CHUNK_ROWS`` at a time, so a table larger than memory is exported with memory for its
ids' order (8 bytes a row) and one chunk. The manifest is written last, atomically: a
folder without one, or whose files do not match it, is not a snapshot.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paramserver import models
from paramserver.errors import ConfigError
from paramserver.server import export as exporting

FORMAT = "paramserver-snapshot-v1"
MANIFEST = "manifest.json"
CHUNK_ROWS = 1 << 16


def sha256(path: Path) -> str:
    """The file's SHA-256, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _entry(root: Path, path: Path) -> dict[str, Any]:
    return {
        "file": str(path.relative_to(root)),
        "bytes": path.stat().st_size,
        "sha256": sha256(path),
    }


def _write_rows(root: Path, name: str, shard: int, held: dict[str, Any]) -> dict[str, Any]:
    """Shard ``shard``'s rows of table ``name`` (its checkpoint's ``ids`` and ``values``,
    mapped) as sorted ids and their values, a chunk at a time."""
    folder = root / "tables" / name
    folder.mkdir(parents=True, exist_ok=True)
    ids = held["ids"].numpy()
    values = held["values"]
    order = np.argsort(ids, kind="stable")
    ids_path, values_path = folder / f"{shard}.ids.npy", folder / f"{shard}.values.npy"
    np.save(ids_path, ids[order])
    out = np.lib.format.open_memmap(
        values_path,
        mode="w+",
        dtype=str(values.dtype).removeprefix("torch."),
        shape=tuple(values.shape),
    )
    for lo in range(0, len(order), CHUNK_ROWS):
        take = torch.from_numpy(order[lo : lo + CHUNK_ROWS])
        out[lo : lo + len(take)] = values[take].numpy()
    out.flush()
    del out
    return {"rows": len(ids), "ids": _entry(root, ids_path), "values": _entry(root, values_path)}


def write(
    directory: str | Path, model: str, seed: int, out: str | Path, round_: int | None = None
) -> tuple[Path, int, str]:
    """Write the serving snapshot of the run whose server checkpoints are in ``directory``
    into the folder ``out``; returns it, the version and which checkpoints it read.

    Raises:
        ConfigError: no consistent set of checkpoints, another model's, or ``out`` is not
            an empty or absent folder.
    """
    root = Path(out)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigError(f"{root} is not an empty folder: a snapshot goes into a new one.")
    paths, which = exporting.files(directory, round_)
    states = [_mapped(p) for p in paths]
    built = models.build(model, seed=seed)
    dense = exporting.assemble(built, states, tables=False)
    layouts = states[0].get("table_layouts") or {}
    for name in layouts:
        dense.pop(f"{name}.weight", None)
    root.mkdir(parents=True, exist_ok=True)
    torch.save(dense, root / "dense.pt")
    tables = {}
    for name, lay in layouts.items():
        shards = [_write_rows(root, name, i, s["tables"][name]) for i, s in enumerate(states)]
        tables[name] = {**{k: lay[k] for k in ("rows", "dim", "dtype", "key")}, "shards": shards}
        tables[name]["init"] = lay.get("init", "normal")
    version = max(int(s["version"]) for s in states)
    manifest = {
        "format": FORMAT,
        "model": model,
        "seed": seed,
        "version": version,
        "shards": len(states),
        "from": which,
        "dense": _entry(root, root / "dense.pt"),
        "tables": tables,
    }
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, root / MANIFEST)
    return root, version, which


def _mapped(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same message
        raise ConfigError(f"Cannot read the checkpoint {path}: {exc}") from exc
