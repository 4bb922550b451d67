"""A worker's pull while it waits under the coordinator's lock: whether it may have its
answer now (the run has started, no cut holds it back, the staleness policy allows it, a
batch is left or the run is over), the answer, and why it timed out.

Decisions only: ``Pull`` reads the coordinator's parts (``Pulled``: the coordinator has
them) and never assigns the coordinator's fields; the coordinator holds the lock, waits on
its condition between tries, and counts the time waited. No I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from paramserver.config import MAX_PUSH_EVERY
from paramserver.errors import InvalidRequest, Timeout
from paramserver.server.answers import PullResult, answer
from paramserver.server.status import Parts

if TYPE_CHECKING:
    from paramserver.server.arrival import Arrival
    from paramserver.server.members import Members
    from paramserver.server.saving import Saving


class Pulled(Parts, Protocol):
    """What a pull reads (the coordinator's parts), under the coordinator's lock."""

    @property
    def members(self) -> Members: ...
    @property
    def arrival(self) -> Arrival: ...
    @property
    def saving(self) -> Saving: ...
    def check_incarnation(self, incarnation: str) -> None: ...


@dataclass(frozen=True)
class Pull:
    """Worker ``worker_id``'s pull of up to ``batches`` batches for ``iteration``, meant for
    server incarnation ``incarnation``; ``sink`` (a writer into the worker's shared
    segment) takes the weights, or the answer holds a snapshot.

    Raises:
        InvalidRequest: ``batches`` is not within 1 to ``MAX_PUSH_EVERY``.
    """

    worker_id: str
    iteration: int
    batches: int = 1
    incarnation: str = ""
    sink: Callable[[np.ndarray], None] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.batches <= MAX_PUSH_EVERY:
            raise InvalidRequest(
                f"A pull may ask for 1 to {MAX_PUSH_EVERY} batches, not {self.batches}."
            )

    def answer(self, c: Pulled) -> PullResult | None:
        """The pull's answer if it can have one now; None: it waits."""
        if c.members.finished:  # nothing left to compute: no staleness to speak of
            return answer(c.store, c.counters, None, None, (), True, self.sink)
        if not self.ready(c):
            return None
        wait = c.arrival.waits_for_batch  # for a batch, or the end
        taken = c.members.hand_out(self.worker_id, self.iteration, self.batches, wait)
        if taken is None:
            return None
        low = c.membership.min_clock()
        return answer(c.store, c.counters, low, self.iteration, taken, sink=self.sink)

    def ready(self, c: Pulled) -> bool:
        """The run has started, no cut holds the pull back, and the policy allows it."""
        if not c.members.started:
            return False
        if c.cuts.full:
            return False  # the cuts taken wait for the disk: no more until one is written
        low = c.membership.min_clock()
        if c.cuts.holds(self.iteration, low):
            return False  # every worker reaches the cut before anyone computes past it
        return c.policy.pull_ready(self.iteration, low, c.rounds)

    def still_meant(self, c: Pulled) -> None:
        """After a wait: the server was not rewound, and the worker still holds its lease.

        Raises:
            WrongIncarnation: rewound while waiting (ABORTED).
            UnknownWorker: evicted while waiting.
        """
        c.check_incarnation(self.incarnation)
        c.membership.get(self.worker_id)

    def timed_out(self, c: Pulled, timeout: float) -> Timeout:
        """Why the pull waited ``timeout`` seconds for nothing."""
        return Timeout(
            c.members.waiting(
                self.worker_id, self.iteration, timeout, c.policy.name, c.saving.waiting()
            )
        )
