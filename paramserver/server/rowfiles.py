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
interval); merging, restoring and reading stream ``CHUNK`` rows of each folder at a time,
never a whole table.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from paramserver.errors import ConfigError
from paramserver.sparse import tablestate
from paramserver.sparse.tablestate import RowBlock, TableChanges

log = logging.getLogger(__name__)
FORMAT = "paramserver-rows-v1"
CHUNK = 1 << 16  # rows read or merged at a time
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
        data = arr.tobytes()
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


def _table_entry(layout: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    tally = {k: int(v) for k, v in meta["tally"].items() if k != "evicted_ids"}
    return {
        "layout": {k: layout[k] for k in ("rows", "dim", "dtype", "key")},
        "steps": int(meta["steps"]),
        "swept": int(meta["swept"]),
        "tally": tally,
    }


def _meta_files(
    root: Path, name: str, meta: dict[str, Any], sketch: np.ndarray | None
) -> dict[str, Any]:
    files = {}
    bits = meta["tally"].get("evicted_ids")
    if bits is not None:
        files["evicted"] = _one(root, f"{name}.evicted.bin", np.asarray(bits), "uint8")
    if sketch is not None:
        files["sketch"] = _one(root, f"{name}.sketch.bin", sketch, str(sketch.dtype))
    return files


def write_changes(
    directory: Path,
    shard: int,
    shards: int,
    seq: int,
    parent: str | None,
    changes: dict[str, TableChanges],
    layouts: dict[str, dict[str, Any]],
) -> tuple[str, str]:
    """Write a delta folder of ``changes`` (a base when ``parent`` is None); returns its
    name and its manifest's SHA-256."""
    name = folder_name(shard, shards, seq)
    folder = _Folder(directory, name)
    try:
        tables = {}
        for table, ch in changes.items():
            widths = [(s.shape[1], str(s.dtype).removeprefix("torch.")) for s in ch.rows.state]
            writer = _TableWriter(folder.root, table, layouts[table], widths)
            writer.add(ch.rows)
            files = writer.close()
            files["removed"] = _one(folder.root, f"{table}.removed.bin", ch.removed, "int64")
            files.update(_meta_files(folder.root, table, ch.meta, ch.sketch))
            tables[table] = {**_table_entry(layouts[table], ch.meta), "files": files}
        manifest = {
            "format": FORMAT,
            "shard": shard,
            "shards": shards,
            "seq": seq,
            "parent": parent,
            "tables": tables,
        }
        path = folder.commit(manifest)
    except BaseException:
        folder.abandon()
        raise
    return name, _sha256(path / "manifest.json")


# --- reading ----------------------------------------------------------------------------


class Folder:
    """A written folder, its manifest read and checked: every file's size and checksum
    (``verify``), then its arrays mapped."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path, self.manifest = path, manifest

    @classmethod
    def open(cls, path: Path, sha256: str | None = None) -> Folder:
        mpath = path / "manifest.json"
        if not mpath.is_file():
            raise ConfigError(f"The row folder {path} is missing or was not written whole.")
        if sha256 is not None and _sha256(mpath) != sha256:
            raise ConfigError(
                f"{mpath} is not the one the checkpoint wrote (its checksum differs): the row "
                "files were replaced or damaged."
            )
        try:
            manifest = json.loads(mpath.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"Cannot read {mpath}: {exc}") from exc
        if manifest.get("format") != FORMAT:
            raise ConfigError(f"{mpath} is not a paramserver row folder ({FORMAT}).")
        return cls(path, manifest)

    def verify(self) -> None:
        """Every file's size and SHA-256 as the manifest says, or ConfigError naming it."""
        for table, entry in self.manifest["tables"].items():
            for key, f in entry["files"].items():
                path = self._file(table, key)
                size = path.stat().st_size if path.exists() else -1
                if size != f["bytes"]:
                    raise ConfigError(
                        f"{path} holds {max(size, 0)} bytes, not the {f['bytes']} its manifest "
                        "says: it is torn or truncated, and is not read."
                    )
                if _sha256(path) != f["sha256"]:
                    raise ConfigError(f"{path} does not match its checksum: it is damaged.")

    def _file(self, table: str, key: str) -> Path:
        return self.path / f"{table}.{key}.bin"

    def array(self, table: str, key: str) -> np.ndarray:
        """An array, memory-mapped (read-only)."""
        f = self.manifest["tables"][table]["files"][key]
        dtype = _torch_dtype(f["dtype"])
        np_dtype = (
            np.int16 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
        )
        shape = tuple(f["shape"])
        if not f["bytes"]:
            return np.empty(shape, np_dtype)
        return np.memmap(self._file(table, key), dtype=np_dtype, mode="r", shape=shape)

    def tensor(self, table: str, key: str, lo: int, hi: int) -> torch.Tensor:
        f = self.manifest["tables"][table]["files"][key]
        part = torch.from_numpy(np.array(self.array(table, key)[lo:hi]))
        return part.view(torch.bfloat16) if f["dtype"] == "bfloat16" else part

    def count(self, table: str) -> int:
        return int(self.manifest["tables"][table]["files"]["ids"]["shape"][0])

    def states(self, table: str) -> int:
        return sum(1 for k in self.manifest["tables"][table]["files"] if k.startswith("state"))

    def block(self, table: str, lo: int, hi: int) -> RowBlock:
        return RowBlock(
            np.array(self.array(table, "ids")[lo:hi]),
            self.tensor(table, "values", lo, hi),
            [self.tensor(table, f"state{i}", lo, hi) for i in range(self.states(table))],
            np.array(self.array(table, "hits")[lo:hi]),
            np.array(self.array(table, "last")[lo:hi]),
        )

    def removed(self, table: str) -> np.ndarray:
        return self.array(table, "removed")


class RowChain:
    """The folders a checkpoint's rows are in, base first: ``restore`` puts them into a
    server's tables, ``merged`` reads one table's rows as the chain's last folder holds
    them."""

    def __init__(self, directory: Path, names: Sequence[str], sums: dict[str, str] | None = None):
        self.directory, self.names, self.sums = Path(directory), list(names), dict(sums or {})
        self._folders: list[Folder] | None = None

    def folders(self) -> list[Folder]:
        """Every folder opened and verified (sizes, checksums, parents), or ConfigError."""
        if self._folders is None:
            out: list[Folder] = []
            for i, name in enumerate(self.names):
                f = Folder.open(self.directory / name, self.sums.get(name))
                parent = f.manifest.get("parent")
                want = self.names[i - 1] if i else None
                if parent != want:
                    raise ConfigError(
                        f"{f.path}'s parent is {parent}, not {want}: the row chain is broken."
                    )
                f.verify()
                out.append(f)
            self._folders = out
        return self._folders

    def tables(self) -> dict[str, Any]:
        return dict(self.folders()[-1].manifest["tables"]) if self.names else {}

    def check_layouts(self, layouts: dict[str, dict[str, Any]], where: str) -> None:
        """The saved tables must be ``layouts`` (this run's): the same names, sizes, dims,
        dtypes and keys; or ConfigError naming the folder."""
        if not self.names:
            return
        head = self.folders()[-1]
        saved = head.manifest["tables"]
        if set(saved) != set(layouts):
            raise ConfigError(
                f"{head.path} holds tables {sorted(saved)}, but {where} has "
                f"{sorted(layouts)}: it is a checkpoint of another model."
            )
        for name, lay in layouts.items():
            have = saved[name]["layout"]
            for key in ("rows", "dim", "dtype", "key"):
                if have[key] != lay[key]:
                    raise ConfigError(
                        f"{head.path}: table {name!r} was saved with {key} {have[key]!r}, but "
                        f"{where} has {lay[key]!r}: another table layout."
                    )

    def restore(self, tables: Any) -> None:
        """Put the chain's rows into ``tables`` (a ``TableSet``): each emptied, then the base
        and every delta in order, ``CHUNK`` rows at a time."""
        self.check_layouts(tables.layouts(), "this server's model")
        for table in tables.tables.values():
            tablestate.clear(table)
        for folder in self.folders():
            for name, table in tables.tables.items():
                removed = folder.removed(name)
                for lo in range(0, len(removed), CHUNK):
                    tablestate.drop_rows(table, np.array(removed[lo : lo + CHUNK]))
                for lo in range(0, folder.count(name), CHUNK):
                    try:
                        tablestate.put_rows(table, folder.block(name, lo, lo + CHUNK))
                    except Exception as exc:  # noqa: BLE001 - any bad row names the folder
                        raise ConfigError(f"{folder.path}: table {name!r}: {exc}") from exc
        head = self.folders()[-1] if self.names else None
        for name, table in tables.tables.items():
            if head is None:
                continue
            entry = head.manifest["tables"][name]
            files = entry["files"]
            bits = head.array(name, "evicted") if "evicted" in files else None
            tally = dict(entry["tally"])
            if bits is not None:
                tally["evicted_ids"] = torch.from_numpy(np.array(bits))
            meta = {"steps": entry["steps"], "swept": entry["swept"], "tally": tally}
            sketch = np.array(head.array(name, "sketch")) if "sketch" in files else None
            tablestate.set_meta(table, meta, sketch)
        log.info(
            "table rows restored from %s: a base and %d deltas, %d rows",
            self.directory,
            len(self.names) - 1,
            tables.held,
        )

    def merged(self, table: str) -> Iterator[RowBlock]:
        """Table ``table``'s rows as the chain's last folder holds them, ids ascending, at
        most ``CHUNK`` rows of each folder at a time: of an id's writes and evictions along
        the chain, the last one counts."""
        folders = self.folders()
        ids = [f.array(table, "ids") for f in folders]
        gone = [f.removed(table) for f in folders]
        pos = [0] * len(folders)
        gpos = [0] * len(folders)
        big = np.iinfo(np.int64).max
        while any(p < len(a) for p, a in zip(pos, ids, strict=True)):
            # the range [lo, hi) holds at most CHUNK ids of each folder
            hi = min(
                int(a[p + CHUNK]) if p + CHUNK < len(a) else big
                for p, a in zip(pos, ids, strict=True)
            )
            parts, tags, kinds = [], [], []
            ends = []
            for k, (a, p) in enumerate(zip(ids, pos, strict=True)):
                end = int(np.searchsorted(a, hi, "left")) if hi != big else len(a)
                ends.append(end)
                parts.append(np.asarray(a[p:end]))
                tags.append(np.full(end - p, k))
                kinds.append(np.ones(end - p, bool))
                g = gone[k]
                gend = int(np.searchsorted(g, hi, "left")) if hi != big else len(g)
                parts.append(np.asarray(g[gpos[k] : gend]))
                tags.append(np.full(gend - gpos[k], k))
                kinds.append(np.zeros(gend - gpos[k], bool))
                gpos[k] = gend
            all_ids, all_tags, wrote = map(np.concatenate, (parts, tags, kinds))
            # the last event of each id: the highest tag (sorted by id, then tag)
            order = np.lexsort((all_tags, all_ids))
            s_ids = all_ids[order]
            last = np.ones(len(s_ids), bool)
            last[:-1] = s_ids[1:] != s_ids[:-1]
            keep = order[last][wrote[order[last]]]
            blocks = []
            for k, (f, p) in enumerate(zip(folders, pos, strict=True)):
                mine = keep[all_tags[keep] == k]
                if len(mine):
                    # positions within folder k's slice [p, end)
                    local = np.searchsorted(ids[k][p : ends[k]], all_ids[mine])
                    blocks.append(f.block(table, p, ends[k]).take(local))
            pos = ends
            if blocks:
                block = RowBlock.cat(blocks)
                yield block.take(np.argsort(block.ids, kind="stable"))


def compact(directory: Path, chain: RowChain, shard: int, shards: int, seq: int) -> tuple[str, str]:
    """A base folder holding what ``chain`` holds, merged on disk a chunk at a time;
    returns its name and manifest's SHA-256."""
    name = folder_name(shard, shards, seq)
    folder = _Folder(directory, name)
    head = chain.folders()[-1]
    try:
        tables = {}
        for table, entry in head.manifest["tables"].items():
            layout = entry["layout"]
            widths = [
                (
                    int(head.manifest["tables"][table]["files"][f"state{i}"]["shape"][1]),
                    head.manifest["tables"][table]["files"][f"state{i}"]["dtype"],
                )
                for i in range(head.states(table))
            ]
            writer = _TableWriter(folder.root, table, layout, widths)
            for block in chain.merged(table):
                writer.add(block)
            files = writer.close()
            files["removed"] = _one(
                folder.root, f"{table}.removed.bin", np.empty(0, np.int64), "int64"
            )
            for key in ("evicted", "sketch"):
                if key in entry["files"]:
                    arr = np.array(head.array(table, key))
                    files[key] = _one(
                        folder.root, f"{table}.{key}.bin", arr, entry["files"][key]["dtype"]
                    )
            tables[table] = {k: v for k, v in entry.items() if k != "files"} | {"files": files}
        manifest = {
            "format": FORMAT,
            "shard": shard,
            "shards": shards,
            "seq": seq,
            "parent": None,
            "tables": tables,
        }
        path = folder.commit(manifest)
    except BaseException:
        folder.abandon()
        raise
    return name, _sha256(path / "manifest.json")


def chain_bytes(chain: RowChain) -> tuple[int, int]:
    """The bytes of the chain's base, and of its deltas."""
    sizes = [
        sum(f["bytes"] for t in folder.manifest["tables"].values() for f in t["files"].values())
        for folder in chain.folders()
    ]
    return (sizes[0] if sizes else 0), sum(sizes[1:])


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
