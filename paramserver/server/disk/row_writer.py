"""A shard's chain of row folders as its checkpointer writes them (``row_format.py`` holds
the format): each snapshot's table changes go into a new folder whose parent is the
previous one; after ``full_every`` deltas the chain is merged on disk into one base
(``--checkpoint-delta-every``); folders no checkpoint file names any more are removed
(those of the chain before the last write a write later).

The chain a checkpoint file names is the chain at the time its snapshot was written, and
snapshots are written in the order they were taken, so every delta's parent holds the rows
as they were when its changes began. A snapshot written again (its checkpoint file failed
after its rows were written) reuses the folder written for it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from paramserver.server.disk import row_format
from paramserver.server.disk.row_reader import RowChain

log = logging.getLogger("paramserver.server.disk.checkpoint_writer")


class RowLog:
    """Shard ``shard`` of ``shards``'s row folders in ``directory``.

    Args:
        resumed: the chain (names, their manifests' SHA-256) of the state the server
            resumed from; None: a fresh start.
        full_every: deltas written before the chain is merged into a new base (0: every
            checkpoint's rows are merged into a base).
    """

    def __init__(
        self,
        directory: Path,
        shard: int,
        shards: int,
        resumed: tuple[list[str], dict[str, str]] | None,
        full_every: int,
    ):
        self.directory, self.shard, self.shards = directory, shard, shards
        self.full_every = full_every
        self.chain, self.sums = resumed if resumed is not None else ([], {})
        found = row_format.existing(directory, shard, shards)
        self.seq = max(found, default=0) + 1
        self._written: tuple[Any, list[str], dict[str, str]] | None = None
        self._before: list[str] = []  # the chain before the last write: kept one write more
        self.merges = 0
        self.merge_failures = 0

    def follow(self, chain: list[str], sums: dict[str, str]) -> None:
        """Go on from ``chain`` (a rewind to a cut that names it)."""
        self.chain, self.sums = list(chain), dict(sums)
        self._written = None

    def write(self, changes: Any, layouts: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        """Write ``changes`` (a snapshot's ``tables``) as the chain's next folder, merged into
        a base when due; returns the chain a checkpoint of it names and the checksums."""
        if self._written is not None and self._written[0] is changes:
            return self._written[1], self._written[2]
        parent = self.chain[-1] if self.chain else None
        self._before = list(self.chain)
        name, sha = row_format.write_changes(
            self.directory, self.shard, self.shards, self.seq, parent, changes, layouts
        )
        self.seq += 1
        self.chain = [*self.chain, name]
        self.sums = {**{n: self.sums[n] for n in self.chain[:-1] if n in self.sums}, name: sha}
        self._written = (changes, list(self.chain), dict(self.sums))
        if len(self.chain) > max(self.full_every, 1):
            try:
                self._merge()
            except Exception as exc:  # noqa: BLE001 - the deltas stay good: merge next time
                self.merge_failures += 1
                log.warning(
                    "merging %d row folders in %s failed (%s: %s); the checkpoint names them "
                    "all, and the next one merges again",
                    len(self.chain),
                    self.directory,
                    type(exc).__name__,
                    exc,
                )
            else:
                self._written = (changes, list(self.chain), dict(self.sums))
        return list(self.chain), dict(self.sums)

    def _merge(self) -> None:
        started = time.perf_counter()
        chain = RowChain(self.directory, self.chain, self.sums)
        name, sha = row_format.compact(self.directory, chain, self.shard, self.shards, self.seq)
        self.seq += 1
        self.chain, self.sums = [name], {name: sha}
        self.merges += 1
        log.info(
            "rows of %d folders merged into %s in %.2fs",
            len(chain.names),
            name,
            time.perf_counter() - started,
        )

    def collect(self) -> None:
        """Remove the row folders that neither the chain, nor the one before the last write,
        nor a checkpoint file on disk names (the chain before is kept one write longer, so
        that a reader, ``paramserver export`` of a live run, that read a checkpoint file
        just replaced still finds its rows)."""
        keep = set(self.chain) | set(self._before)
        for path in self.directory.glob("server-*.pt"):
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception:  # noqa: BLE001 - a file being replaced: keep everything
                return
            keep.update(saved.get("row_chain") or ())
        row_format.collect(self.directory, self.shard, self.shards, keep)
