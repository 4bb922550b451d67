"""When a shard of a sharded run cuts: pure decisions, no I/O, no locks.

Every shard cuts its state at the same points, so that a run whose shard restarts from its
newest cut can bring every other shard back to the same point. Under ``sync`` a cut is the
end of every N-th round. Under ``ssp:K`` and ``async`` it is the moment every live worker's
clock reaches the next multiple of N: a pull for that iteration or later waits until then,
as a sync round would, so no worker computes past a cut that is not taken.
"""

from __future__ import annotations

from typing import Any


class Cuts:
    """The cut schedule of one shard and the states taken, waiting to be written.

    Args:
        every: N, in iterations (sync: rounds); None: this server does not cut.
        synchronous: the run's policy is sync.
    """

    def __init__(self, every: int | None = None, synchronous: bool = False):
        self.every = every
        self.synchronous = synchronous
        self.last = 0  # the clock (sync: the round) of the last cut
        self.pending: list[dict[str, Any]] = []

    def after_round(self, rounds: int) -> int | None:
        """Under sync: the cut that the end of round ``rounds`` makes, if any."""
        if self.every and self.synchronous and rounds % self.every == 0:
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

    def take(self, clock: int, state: dict[str, Any]) -> None:
        self.last = clock
        self.pending.append(state)

    def drain(self) -> list[dict[str, Any]]:
        states, self.pending = self.pending, []
        return states
