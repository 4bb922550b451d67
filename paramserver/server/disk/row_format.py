"""The sparse tables' rows on disk, per shard: each checkpoint writes only the rows changed
since the previous one (a delta folder), and now and then the chain of them is merged on
disk into one base folder. A checkpoint file names its chain (``row_chain``); restoring is
the base, then every delta in order.

A folder ``rows-shardIofS-SEQ/`` holds, per table, raw arrays (``NAME.ids.bin``: int64,
sorted; ``NAME.values.bin``, ``NAME.state0.bin``..., ``NAME.hits.bin``, ``NAME.last.bin``;
``NAME.removed.bin``: the ids evicted since the parent, sorted; ``NAME.evicted.bin`` and
``NAME.sketch.bin``: the lifecycle's bitset and admission sketch), and ``manifest.json``
last: format, shard, shards, its parent folder, each table's layout and counters, and each
file's dtype, shape, size and SHA-256. A folder is written under a hidden name and renamed
when whole, so a kill leaves either nothing or a whole folder; a file torn, truncated or
changed later fails its size or checksum and is never read as good (``ConfigError``
naming the file).

Memory: a delta is written from the rows its snapshot copied (the rows changed in one
interval); merging, restoring and reading stream a chunk of each folder at a time
(``chunk_rows``: about ``CHUNK_BYTES`` of rows),
never a whole table.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from paramserver.sparse.tablestate import RowBlock, TableChanges

log = logging.getLogger(__name__)
FORMAT = "paramserver-rows-v1"
CHUNK = 1 << 16  # rows read or merged at a time, at most
CHUNK_BYTES = 4 << 20  # ... and about this many bytes of rows (values, state, counters)


def chunk_rows(entry: dict[str, Any]) -> int:
    """The rows of a chunk of one table (its manifest ``entry``): ``CHUNK_BYTES`` of them,
    at most ``CHUNK``."""
    files = entry["files"]
    row = sum(
        int(np.prod(f["shape"][1:], dtype=np.int64))
        * torch.empty(0, dtype=_torch_dtype(f["dtype"])).element_size()
        for key, f in files.items()
        if key in ("ids", "values", "hits", "last") or key.startswith("state")
    )
    return int(max(1, min(CHUNK, CHUNK_BYTES // max(row, 1))))


HASH_READ = 1 << 20


def folder_name(shard: int, shards: int, seq: int) -> str:
    return f"rows-shard{shard}of{shards}-{seq:09d}"


def _pattern(shard: int, shards: int) -> re.Pattern[str]:
    return re.compile(rf"rows-shard{shard}of{shards}-(\d{{9}})$")


def _np(t: torch.Tensor) -> np.ndarray:
    """A tensor as numpy (bfloat16, which numpy lacks, as its bits)."""
    t = t.detach().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)  # type: ignore[no-any-return]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_READ):
            h.update(block)
    return h.hexdigest()


class _Array:
    """One raw array file written in appended chunks, hashed as written."""

    def __init__(self, path: Path, torch_dtype: str, width: int):
        self.path, self.torch_dtype, self.width = path, torch_dtype, width
        self.f: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed by ``close``
        self.h = hashlib.sha256()
        self.rows = 0

    def add(self, part: np.ndarray | torch.Tensor) -> None:
        arr = _np(part) if isinstance(part, torch.Tensor) else np.ascontiguousarray(part)
        data = arr.reshape(-1).view(np.uint8).data  # its bytes, no copy
        self.f.write(data)
        self.h.update(data)
        self.rows += len(arr)

    def close(self) -> dict[str, Any]:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        shape = [self.rows] if self.width == 0 else [self.rows, self.width]
        return {
            "dtype": self.torch_dtype,
            "shape": shape,
            "bytes": self.path.stat().st_size,
            "sha256": self.h.hexdigest(),
        }


class _TableWriter:
    """One table's arrays in a folder being written."""

    def __init__(
        self, root: Path, name: str, layout: dict[str, Any], widths: list[tuple[int, str]]
    ):
        dim, dtype = int(layout["dim"]), str(layout["dtype"])
        self.arrays = {
            "ids": _Array(root / f"{name}.ids.bin", "int64", 0),
            "values": _Array(root / f"{name}.values.bin", dtype, dim),
            **{
                f"state{i}": _Array(root / f"{name}.state{i}.bin", kind, width)
                for i, (width, kind) in enumerate(widths)
            },
            "hits": _Array(root / f"{name}.hits.bin", "int32", 0),
            "last": _Array(root / f"{name}.last.bin", "int32", 0),
        }

    def add(self, block: RowBlock) -> None:
        a = self.arrays
        a["ids"].add(block.ids.astype(np.int64))
        a["values"].add(block.values)
        for i, s in enumerate(block.state):
            a[f"state{i}"].add(s)
        a["hits"].add(block.hits.astype(np.int32))
        a["last"].add(block.last.astype(np.int32))

    def close(self) -> dict[str, Any]:
        return {key: arr.close() for key, arr in self.arrays.items()}


def _one(root: Path, path_name: str, arr: np.ndarray, dtype: str) -> dict[str, Any]:
    a = _Array(root / path_name, dtype, 0)
    a.add(arr)
    return a.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Folder:
    """A folder being written under a hidden name; ``commit`` writes the manifest and
    renames it into place."""

    def __init__(self, directory: Path, name: str):
        self.final = directory / name
        self.root = directory / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)

    def commit(self, manifest: dict[str, Any]) -> Path:
        path = self.root / "manifest.json"
        with open(path, "w") as f:
            json.dump(manifest, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.root)
        os.replace(self.root, self.final)
        _fsync_dir(self.final.parent)
        return self.final

    def abandon(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass(frozen=True)
class TableSource:
    """One table of a folder to write: its layout (rows, dim, dtype, key), its optimizer
    state's widths and dtypes, its rows (``blocks``, ids ascending, a chunk at a time), the
    ids gone since the parent folder, and its counters and lifecycle arrays."""

    layout: dict[str, Any]
    widths: list[tuple[int, str]]
    blocks: Iterable[RowBlock]
    removed: np.ndarray
    steps: int
    swept: int
    tally: dict[str, int]
    evicted: np.ndarray | None  # the lifecycle's bitset of evicted ids (packed)
    sketch: np.ndarray | None  # the admission sketch's counters


def from_changes(ch: TableChanges, layout: dict[str, Any]) -> TableSource:
    """A table's changes (``tablestate.take_changes``) as a folder holds them."""
    bits = ch.meta["tally"].get("evicted_ids")
    return TableSource(
        layout,
        [(s.shape[1], str(s.dtype).removeprefix("torch.")) for s in ch.rows.state],
        [ch.rows],
        ch.removed,
        int(ch.meta["steps"]),
        int(ch.meta["swept"]),
        {k: int(v) for k, v in ch.meta["tally"].items() if k != "evicted_ids"},
        None if bits is None else np.asarray(bits),
        ch.sketch,
    )


def write_folder(
    directory: Path,
    shard: int,
    shards: int,
    seq: int,
    parent: str | None,
    tables: dict[str, TableSource],
) -> tuple[str, str]:
    """Write a folder of ``tables`` (a base when ``parent`` is None), each table's rows
    streamed; returns its name and its manifest's SHA-256."""
    name = folder_name(shard, shards, seq)
    folder = _Folder(directory, name)
    try:
        entries = {}
        for table, src in tables.items():
            writer = _TableWriter(folder.root, table, src.layout, src.widths)
            for block in src.blocks:
                writer.add(block)
            files = writer.close()
            files["removed"] = _one(folder.root, f"{table}.removed.bin", src.removed, "int64")
            if src.evicted is not None:
                files["evicted"] = _one(folder.root, f"{table}.evicted.bin", src.evicted, "uint8")
            if src.sketch is not None:
                files["sketch"] = _one(
                    folder.root, f"{table}.sketch.bin", src.sketch, str(src.sketch.dtype)
                )
            entries[table] = {
                "layout": {k: src.layout[k] for k in ("rows", "dim", "dtype", "key")},
                "steps": src.steps,
                "swept": src.swept,
                "tally": dict(src.tally),
                "files": files,
            }
        manifest = {
            "format": FORMAT,
            "shard": shard,
            "shards": shards,
            "seq": seq,
            "parent": parent,
            "tables": entries,
        }
        path = folder.commit(manifest)
    except BaseException:
        folder.abandon()
        raise
    return name, _sha256(path / "manifest.json")


def write_changes(
    directory: Path,
    shard: int,
    shards: int,
    seq: int,
    parent: str | None,
    changes: dict[str, TableChanges],
    layouts: dict[str, dict[str, Any]],
) -> tuple[str, str]:
    """Write a delta folder of ``changes`` (a base when ``parent`` is None)."""
    tables = {t: from_changes(ch, layouts[t]) for t, ch in changes.items()}
    return write_folder(directory, shard, shards, seq, parent, tables)


def compact(directory: Path, chain: Any, shard: int, shards: int, seq: int) -> tuple[str, str]:
    """A base folder holding what ``chain`` (a ``row_reader.RowChain``) holds, merged on disk a
    chunk at a time; returns its name and manifest's SHA-256."""
    head = chain.folders()[-1]
    tables = {}
    for table, entry in head.manifest["tables"].items():
        files = entry["files"]
        tables[table] = TableSource(
            entry["layout"],
            widths(entry),
            chain.merged(table),
            np.empty(0, np.int64),
            int(entry["steps"]),
            int(entry["swept"]),
            dict(entry["tally"]),
            np.array(head.array(table, "evicted")) if "evicted" in files else None,
            np.array(head.array(table, "sketch")) if "sketch" in files else None,
        )
    return write_folder(directory, shard, shards, seq, None, tables)


def widths(entry: dict[str, Any]) -> list[tuple[int, str]]:
    """The widths and dtypes of a table's optimizer state, from its manifest ``entry``."""
    files = entry["files"]
    count = sum(1 for k in files if k.startswith("state"))
    return [
        (int(files[f"state{i}"]["shape"][1]), files[f"state{i}"]["dtype"]) for i in range(count)
    ]


def existing(directory: Path, shard: int, shards: int) -> dict[int, str]:
    """This shard's row folders in ``directory``, by sequence number."""
    pattern = _pattern(shard, shards)
    out = {}
    for path in directory.glob(f"rows-shard{shard}of{shards}-*"):
        m = pattern.match(path.name)
        if m and path.is_dir():
            out[int(m[1])] = path.name
    return out


def collect(directory: Path, shard: int, shards: int, keep: set[str]) -> list[str]:
    """Remove this shard's row folders not in ``keep``, and folders left half written by
    a killed writer; returns the names removed."""
    gone = []
    for name in existing(directory, shard, shards).values():
        if name not in keep:
            shutil.rmtree(directory / name, ignore_errors=True)
            gone.append(name)
    for tmp in directory.glob(f".rows-shard{shard}of{shards}-*.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid():
            shutil.rmtree(tmp, ignore_errors=True)
            gone.append(tmp.name)
    return gone
