"""Reading the tables' row folders (``row_format.py`` writes them and describes the format):
``Folder`` checks a folder's files against its manifest and maps its arrays; ``RowChain``
is the chain a checkpoint names, base first: ``restore`` puts it into a server's tables,
``merged`` reads one table's rows as the chain's last folder holds them. Both read
a chunk of a folder at a time (``row_format.chunk_rows``), never a whole table.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paramserver.errors import ConfigError
from paramserver.server.disk import row_format
from paramserver.server.disk.row_format import FORMAT, _sha256, _torch_dtype
from paramserver.sparse import tablestate
from paramserver.sparse.tablestate import RowBlock

log = logging.getLogger("paramserver.server.disk.row_format")


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
                itemsize = torch.empty(0, dtype=_torch_dtype(f["dtype"])).element_size()
                if f["bytes"] != int(np.prod(f["shape"], dtype=np.int64)) * itemsize:
                    raise ConfigError(
                        f"{self.path / 'manifest.json'}: {path.name} is said to hold "
                        f"{f['bytes']} bytes of {f['dtype']} {f['shape']}: the manifest is "
                        "not one paramserver wrote."
                    )
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
        and every delta in order, a chunk at a time."""
        self.check_layouts(tables.layouts(), "this server's model")
        for table in tables.tables.values():
            tablestate.clear(table)
        for folder in self.folders():
            for name, table in tables.tables.items():
                removed = folder.removed(name)
                step = row_format.chunk_rows(folder.manifest["tables"][name])
                for lo in range(0, len(removed), row_format.CHUNK):
                    tablestate.drop_rows(table, np.array(removed[lo : lo + row_format.CHUNK]))
                for lo in range(0, folder.count(name), step):
                    try:
                        tablestate.put_rows(table, folder.block(name, lo, lo + step))
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
        most a chunk (``row_format.chunk_rows``) of each folder at a time: of an id's writes and evictions along
        the chain, the last one counts."""
        folders = self.folders()
        chunk = row_format.chunk_rows(folders[-1].manifest["tables"][table]) if folders else 1
        ids = [f.array(table, "ids") for f in folders]
        gone = [f.removed(table) for f in folders]
        pos = [0] * len(folders)
        gpos = [0] * len(folders)
        big = np.iinfo(np.int64).max
        while any(p < len(a) for p, a in zip(pos, ids, strict=True)):
            # the range [lo, hi) holds at most ``chunk`` ids of each folder
            hi = min(
                int(a[p + chunk]) if p + chunk < len(a) else big
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
                    read = f.block(table, p, ends[k])
                    blocks.append(read if len(local) == len(read) else read.take(local))
            pos = ends
            if len(blocks) == 1:  # one folder's rows: in id order already
                yield blocks[0]
            elif blocks:
                block = RowBlock.cat(blocks)
                yield block.take(np.argsort(block.ids, kind="stable"))
