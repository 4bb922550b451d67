"""A serving snapshot of a run, written from its servers' checkpoints (``paramserver export
--snapshot DIR``): what a serving process loads with no server running.

Layout of DIR:

- ``manifest.json``: format, model, seed, version, shard count, which checkpoints it was
  made from, the dense file, and per table its rows (0: unbounded), dim, dtype,
  initialiser, key and its shards' files; every file with its size and SHA-256;
- ``dense.pt``: the model's parameters and buffers, its sparse tables left out;
- ``tables/NAME/I.ids.npy`` and ``I.values.npy``: shard I's rows of table NAME, ids sorted,
  their values in the same order (``.npy``: a loader maps them, reading pages on demand).

A delta (``--base FULL[,DELTA...]``, the chain it follows) holds the dense part whole, and of
each table only the rows that changed since the chain's last snapshot, and the ids it held
that the run no longer holds (``I.evicted.npy``); its manifest names its base (the last
snapshot's version and the SHA-256 of its manifest). ``served.load`` applies them in order.

Streamed: a shard's rows are read from its row files (``server/disk/row_format.py``) a chunk at a
time, merged in id order, and written so, so a table larger than memory is exported with
memory for a few chunks (a delta also keeps the ids held, 8 bytes a row, to find those
gone). The manifest is written last, atomically: a
folder without one, or whose files do not match it, is not a snapshot. A new DIR is
written as a hidden folder beside it, renamed to DIR once whole; an existing (empty) DIR
is written in place and emptied again on a failure: a refused or failed export leaves DIR
as it was (absent or empty).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paramserver import models
from paramserver.errors import ConfigError
from paramserver.server.disk import checkpoint
from paramserver.server.disk import export as exporting
from paramserver.serving.layers import (
    FORMAT,
    MANIFEST,
    Layer,
    ShardRows,
    check_chain,
    read_manifest,
    sha256,
)

CHUNK_ROWS = 1 << 16


def _entry(root: Path, path: Path) -> dict[str, Any]:
    return {
        "file": str(path.relative_to(root)),
        "bytes": path.stat().st_size,
        "sha256": sha256(path),
    }


def _blocks(state: dict[str, Any], name: str) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
    """A shard's rows of table ``name``, ids ascending, a chunk at a time: from its row
    files (``row_reader.RowChain.merged``), or an older checkpoint's mapped ``tables``."""
    tables = state["tables"]
    if hasattr(tables, "merged"):
        for block in tables.merged(name):
            yield block.ids, block.values
        return
    held = tables[name]
    ids, values = held["ids"].numpy(), held["values"]
    order = np.argsort(ids, kind="stable")
    for lo in range(0, len(order), CHUNK_ROWS):
        take = order[lo : lo + CHUNK_ROWS]
        yield ids[take], values[torch.from_numpy(take)]


def _npy(raw: Path, out: Path, dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
    """``out``: the ``.npy`` of the raw array in ``raw`` (copied a MiB at a time), which goes."""
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    with open(out, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        with open(raw, "rb") as r:
            shutil.copyfileobj(r, f, 1 << 20)
    raw.unlink()


def _write_rows(
    root: Path,
    name: str,
    shard: int,
    blocks: Iterator[tuple[np.ndarray, torch.Tensor]],
    lay: dict[str, Any],
    base: ShardRows | None,
) -> dict[str, Any]:
    """Shard ``shard``'s rows of table ``name`` (``blocks``: ids ascending, a chunk at a
    time) as sorted ids and their values; against ``base`` (a delta): only the rows that
    differ from it, and the ids it held that are gone."""
    folder = root / "tables" / name
    folder.mkdir(parents=True, exist_ok=True)
    ids_path, values_path = folder / f"{shard}.ids.npy", folder / f"{shard}.values.npy"
    ids_raw, values_raw = folder / f".{shard}.ids.raw", folder / f".{shard}.values.raw"
    every, count = [], 0
    dtype = np.dtype(str(lay["dtype"]))
    with open(ids_raw, "wb") as fi, open(values_raw, "wb") as fv:
        for ids, values in blocks:
            rows = values.numpy()
            if base is not None:  # which rows differ from the chain's
                every.append(ids)
                old, found = base.resolve(ids)
                keep = ~found | (old != rows).any(axis=1)
                ids, rows = ids[keep], rows[keep]
            fi.write(np.ascontiguousarray(ids, np.int64).tobytes())
            fv.write(np.ascontiguousarray(rows, dtype).tobytes())
            count += len(ids)
    _npy(ids_raw, ids_path, np.dtype(np.int64), (count,))
    _npy(values_raw, values_path, dtype, (count, int(lay["dim"])))
    entry: dict[str, Any] = {}
    if base is not None:
        held = np.concatenate(every) if every else np.empty(0, np.int64)
        gone = np.setdiff1d(base.held(), held)
        evicted_path = folder / f"{shard}.evicted.npy"
        np.save(evicted_path, gone)
        entry["evicted"] = _entry(root, evicted_path)
    entry.update(rows=count, ids=_entry(root, ids_path), values=_entry(root, values_path))
    return entry


def write(
    directory: str | Path,
    model: str,
    seed: int,
    out: str | Path,
    round_: int | None = None,
    bases: Sequence[str | Path] = (),
) -> tuple[Path, int, str]:
    """Write the serving snapshot of the run whose server checkpoints are in ``directory``
    into the folder ``out``; returns it, the version and which checkpoints it read.
    ``bases``: the chain (a full snapshot, then its deltas) this one is a delta of.

    Raises:
        ConfigError: no consistent set of checkpoints, another model's, ``out`` is not an
            empty or absent folder, or ``bases`` is no chain of this run's model.
    """
    root = Path(out)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigError(f"{root} is not an empty folder: a snapshot goes into a new one.")
    chain = [read_manifest(b) for b in bases]
    if chain:
        check_chain(chain)
    paths, which = exporting.files(directory, round_)
    states = [_mapped(p) for p in paths]
    built = models.build(model, seed=seed)
    dense = exporting.assemble(built, states, tables=False)
    layouts = states[0].get("table_layouts") or {}
    for name in layouts:
        dense.pop(f"{name}.weight", None)
    _check_loads(built, dense, layouts, directory, model)  # before anything is written
    if chain and (chain[-1][1]["model"], chain[-1][1]["shards"]) != (model, len(states)):
        raise ConfigError(
            f"{chain[-1][0]} is a snapshot of {chain[-1][1]['model']!r} on "
            f"{chain[-1][1]['shards']} shards, not of this run's {model!r} on {len(states)}."
        )
    for name in layouts if chain else ():
        if any(name not in m["tables"] for _, m in chain):
            raise ConfigError(f"The base snapshots hold no table {name!r}: not this run's model.")
    # Written into a new folder beside ``root`` and renamed into place whole, or into
    # ``root`` itself where it exists already (empty: a mount point, or a parent that may
    # not be written), emptied again on a failure: a refusal or a failure on the way (a
    # full disk, a kill) leaves no partial snapshot in the way of the retry.
    made = not root.exists()
    work = root.parent / f".{root.name}.tmp-{os.getpid()}" if made else root
    if made:
        root.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
    try:
        version = _write_all(work, model, seed, which, dense, layouts, states, chain)
        if made:
            os.rename(work, root)
    except BaseException:
        if made:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for child in list(root.iterdir()):
                shutil.rmtree(child) if child.is_dir() else child.unlink(missing_ok=True)
        raise
    return root, version, which


def _write_all(
    root: Path,
    model: str,
    seed: int,
    which: str,
    dense: dict[str, torch.Tensor],
    layouts: dict[str, Any],
    states: list[dict[str, Any]],
    chain: list[tuple[Path, dict[str, Any]]],
) -> int:
    """Every file of the snapshot into ``root``, the manifest last; returns its version."""
    torch.save(dense, root / "dense.pt")
    tables = {}
    for name, lay in layouts.items():
        shards = []
        for i, s in enumerate(states):
            base = _base_rows(chain, name, i, lay) if chain else None
            shards.append(_write_rows(root, name, i, _blocks(s, name), lay, base))
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
    if chain:
        last, head = chain[-1]
        manifest["base"] = {
            "version": head["version"],
            "manifest_sha256": sha256(last / MANIFEST),
        }
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, root / MANIFEST)
    return version


def _check_loads(
    built: torch.nn.Module,
    dense: dict[str, torch.Tensor],
    layouts: dict[str, Any],
    directory: str | Path,
    model: str,
) -> None:
    """The dense part loads into ``built`` (its tables aside), or ConfigError: the
    checkpoints are another model's."""
    tables = {f"{name}.weight" for name in layouts}
    own = {k: v for k, v in built.state_dict().items() if k in tables}  # not in the dense part
    differs = models.state_difference(built, {**own, **dense})
    if differs:
        raise ConfigError(
            f"The checkpoints in {directory} do not load into --model {model}: {differs}."
        )


def _base_rows(
    chain: list[tuple[Path, dict[str, Any]]], name: str, shard: int, lay: dict[str, Any]
) -> ShardRows:
    """Table ``name``'s rows on ``shard`` as the chain holds them."""
    if any(name not in m["tables"] for _, m in chain):
        raise ConfigError(f"The base snapshots hold no table {name!r}: not this run's model.")
    layers = [Layer.open(root, m["tables"][name]["shards"][shard]) for root, m in chain]
    return ShardRows(layers, int(lay["dim"]), str(lay["dtype"]))


def _mapped(path: Path) -> dict[str, Any]:
    state = checkpoint.read(path, mmap=True)
    try:
        return checkpoint.with_rows(state, path)
    except Exception as exc:  # noqa: BLE001 - its row files: the same sentence
        raise checkpoint.unreadable(path, exc) from None
