"""The coordinator's side of the disk: the cuts taken and waiting to be written
(``server/bookkeeping/cuts.py`` says when), and what the checkpointer reports of its writes
(``server/bookkeeping/write_record.py``).

A collaborator of the coordinator: ``Saving`` owns ``cuts`` and ``saves`` (``bookkeeping/cuts.py``, ``bookkeeping/write_record.py``), and guards them
with the coordinator's lock (``cond``, shared: a cut on disk wakes the pulls that wait for
room). The checkpointer calls it; the coordinator takes the cuts (``take``, under its lock)
and reads it for pulls and status.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from paramserver.server.bookkeeping.cuts import Cuts
from paramserver.server.bookkeeping.snapshot import CoordinatorSnapshot
from paramserver.server.bookkeeping.write_record import Saves


class Saving:
    """Cuts and checkpoint writes, under the coordinator's lock.

    Args:
        cond: the coordinator's condition (its lock, and the pulls waiting on it).
        in_rounds: cuts fall at the end of sync rounds (``Arrival.in_rounds``), not when
            every live clock reaches one.
    """

    def __init__(self, cond: threading.Condition, in_rounds: bool):
        self._cond = cond
        self.cuts: Cuts[CoordinatorSnapshot] = Cuts(synchronous=in_rounds)
        self.saves = Saves()  # the checkpointer's writes: the last one, failures
        # the row folders of the state taken over (``resumed``): the next row delta's parent
        self.rows: tuple[list[str], dict[str, str]] | None = None

    def schedule(self, every: int | None) -> None:
        """Cut every ``every`` iterations (sync: rounds); None: never (the default)."""
        with self._cond:
            self.cuts.every = every

    def take(self, cut: int, snapshot: CoordinatorSnapshot) -> None:
        """Keep the state taken at ``cut`` until it is on disk (the caller holds the lock)."""
        self.cuts.take(cut, snapshot)

    def resumed(self, s: CoordinatorSnapshot) -> None:
        """The coordinator took over snapshot ``s``: its last cut, its version, and the row
        folders its tables came from (and their checksums)."""
        self.cuts.last = s.cut
        self.saves.version = s.version
        self.rows = (list(s.row_chain), dict(s.row_sums or {})) if s.row_chain is not None else None

    def rewound(self, cut: int, on_disk: Iterable[int]) -> None:
        """Back at the cut at ``cut``: the cuts after it are abandoned (``on_disk``: those
        left on disk)."""
        self.cuts.rewound(cut, on_disk)

    @property
    def cuts_pending(self) -> bool:
        return bool(self.cuts.pending)

    def oldest_cut(self) -> CoordinatorSnapshot | None:
        """The oldest cut taken and not yet on disk; it stays taken until ``cut_on_disk``."""
        with self._cond:
            return self.cuts.oldest()

    def pending_cut(self, clock: int) -> CoordinatorSnapshot | None:
        with self._cond:
            return self.cuts.pending_at(clock)

    def cut_on_disk(self, clock: int) -> None:
        """The cut at ``clock`` is written: it leaves memory, and pulls waiting for room
        go on."""
        with self._cond:
            self.cuts.on_disk(clock)
            self._cond.notify_all()

    def learn_common_cut(self, clock: int) -> None:
        """A worker says every shard has written the cut at ``clock`` (PullRequest)."""
        if clock > self.cuts.common:
            with self._cond:
                self.cuts.learn_common(clock)

    def saved(self, version: int, at: float) -> None:
        """Record that a checkpoint of ``version`` was written at wall time ``at``."""
        with self._cond:
            self.saves.succeeded(version, at)

    def save_failed(self, error: str, at: float) -> None:
        """Record that a checkpoint write failed at wall time ``at``."""
        with self._cond:
            self.saves.failed(error, at)

    def waiting(self) -> str:
        """What the cuts add to why a pull waits: none, or that they wait for the disk."""
        if not self.cuts.full:
            return ""
        return (
            f" {len(self.cuts.pending)} consistent cuts wait to be written to disk"
            f" ({self.saves.error or 'a slow disk'})."
        )
