"""When a shard of a sharded run cuts: pure decisions, no I/O, no locks.

Every shard cuts its state at the same points, so that a run whose shard restarts from its
newest cut can bring every other shard back to the same point. Under ``sync`` a cut is the
end of every N-th round. Under ``ssp:K`` and ``async`` it is the moment every live worker's
clock reaches the next multiple of N: a pull for that iteration or later waits until then,
as a sync round would, so no worker computes past a cut that is not taken.

A cut stays in ``pending`` (a full copy of the shard's state) until it is on disk, and at
most ``MAX_PENDING`` wait there: while they do, pulls wait, so a slow or failing disk slows
the run instead of filling memory. Each shard keeps on disk every cut from the newest one
that every shard has written (``common``, learned through the workers: each pull says the
smallest ``cut_written`` its shards last reported), so the newest cut of any shard that
restarts is on every other shard's disk, or in its memory waiting to be written.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Generic, Protocol, TypeVar

# Cuts taken and not yet on disk, at most; pulls wait while this many are.
MAX_PENDING = 2


class Cut(Protocol):
    """A state taken at a cut: ``state["cut"]`` is its clock (a ``CoordinatorSnapshot``,
    or a dict)."""

    def __getitem__(self, key: str, /) -> Any: ...


S = TypeVar("S", bound=Cut)


class Cuts(Generic[S]):
    """The cut schedule of one shard and the states taken, waiting to be written.

    Args:
        every: N, in iterations (sync: rounds); None: this server does not cut.
        synchronous: cuts come at the end of rounds (the coordinator's ``Rounds``), not
            when every live clock reaches one.
        last: the clock (sync: the round) of the last cut (a resumed shard's).
    """

    def __init__(self, every: int | None = None, synchronous: bool = False, last: int = 0):
        self.every = every
        self.synchronous = synchronous
        self.last = last  # the clock (sync: the round) of the last cut
        self.pending: list[S] = []  # taken, oldest first, not yet on disk
        self.written = 0  # the newest cut on disk
        self.common = 0  # the newest cut every shard has written, as last learned

    def after_round(self, rounds: int) -> int | None:
        """Under sync: the cut that the end of round ``rounds`` makes, if any."""
        if self.every and self.synchronous and rounds % self.every == 0:
            return rounds
        return None

    def at_end(self, rounds: int) -> int | None:
        """Under sync, when the last worker has left after round ``rounds`` (the run's end):
        a cut there, if the last one is older, so that a shard restarted after the run
        resumes at its end (no worker is left to train the rounds past an older cut)."""
        if self.every and self.synchronous and rounds > self.last:
            return rounds
        return None

    @property
    def next(self) -> int | None:
        """Under ssp:K and async: the clock of the next cut."""
        if not self.every or self.synchronous:
            return None
        return (self.last // self.every + 1) * self.every

    def reached(self, min_clock: int | None) -> int | None:
        """Under ssp:K and async: the cut that every live clock has reached, if any."""
        cut = self.next
        if cut is not None and min_clock is not None and min_clock >= cut:
            return cut
        return None

    def holds(self, iteration: int, min_clock: int | None) -> bool:
        """Whether a pull of ``iteration`` must wait for the next cut to be taken."""
        cut = self.next
        return cut is not None and iteration >= cut and (min_clock is None or min_clock < cut)

    def take(self, clock: int, state: S) -> None:
        self.last = clock
        self.pending.append(state)

    @property
    def full(self) -> bool:
        """Whether pulls must wait for a cut to be written."""
        return len(self.pending) >= MAX_PENDING

    def oldest(self) -> S | None:
        """The oldest cut not yet on disk; it stays pending until ``on_disk``."""
        return self.pending[0] if self.pending else None

    def on_disk(self, clock: int) -> None:
        """The cut at ``clock`` was written: it leaves ``pending``."""
        self.pending = [s for s in self.pending if int(s["cut"]) != clock]
        self.written = max(self.written, clock)

    def pending_at(self, clock: int) -> S | None:
        """The cut at ``clock`` if it is taken and not yet on disk."""
        return next((s for s in self.pending if int(s["cut"]) == clock), None)

    def rewound(self, clock: int, on_disk: Iterable[int]) -> None:
        """Back at the cut at ``clock``: the cuts after it are abandoned (``on_disk``: the
        cuts left on disk)."""
        self.last = clock
        self.pending = [s for s in self.pending if int(s["cut"]) <= clock]
        self.written = max((c for c in on_disk if c <= clock), default=0)
        self.common = min(self.common, clock)

    def learn_common(self, clock: int) -> None:
        """A worker says every shard has written the cut at ``clock`` (or a newer one).
        What it says can be stale, never ahead of this shard's own disk."""
        self.common = max(self.common, min(clock, self.written))

    def deletable(self, on_disk: Iterable[int]) -> list[int]:
        """The cuts on disk that no restart can need: older than the newest cut every shard
        has written (a restarted shard resumes from its newest, which is never older)."""
        keep_from = min(self.common, self.written)
        return sorted(c for c in on_disk if c < keep_from)
