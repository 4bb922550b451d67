"""A worker's pull while it waits under the coordinator's lock: whether it may have its
answer now (the run has started, no cut holds it back, the staleness policy allows it, a
batch is left or the run is over), the answer, and why it timed out.

``Pull`` reads the coordinator's parts (``Pulled``: the coordinator has them) and never
assigns the coordinator's fields; ``wait`` waits on the coordinator's condition (its caller
holds the lock) between tries, and counts the time waited. No I/O.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from paramserver.config import MAX_PUSH_EVERY
from paramserver.errors import InvalidRequest, Timeout
from paramserver.server.bookkeeping.status import Parts
from paramserver.server.engine.answers import PullResult, answer

if TYPE_CHECKING:
    from paramserver.config import ServerConfig
    from paramserver.server.engine.arrival import Arrival
    from paramserver.server.engine.dense_apply import Applies
    from paramserver.server.engine.members import Members
    from paramserver.server.engine.saving import Saving


class Pulled(Parts, Protocol):
    """What a pull reads (the coordinator's parts), under the coordinator's lock."""

    @property
    def members(self) -> Members: ...
    @property
    def arrival(self) -> Arrival: ...
    @property
    def saving(self) -> Saving: ...
    @property
    def applies(self) -> Applies: ...
    @property
    def config(self) -> ServerConfig: ...
    def check_incarnation(self, incarnation: str) -> None: ...


@dataclass(frozen=True)
class Pull:
    """Worker ``worker_id``'s pull of up to ``batches`` batches for ``iteration``, meant for
    server incarnation ``incarnation``; ``sink`` (a writer into the worker's shared
    segment) takes the weights, or the answer holds a snapshot.

    Under ``ssp:K`` and ``async`` a worker that finds no batch left waits for one (a batch
    given back by a dead worker) or for the end of the run, unless it holds an earlier batch
    not pushed yet (a prefetch: the end would wait for it); then, as under ``sync``, it gets
    batch -1 and pushes an empty gradient.

    Raises:
        InvalidRequest: ``batches`` is not within 1 to ``MAX_PUSH_EVERY``.
    """

    worker_id: str
    iteration: int
    batches: int = 1
    incarnation: str = ""
    sink: Callable[[np.ndarray], None] | None = None
    ahead: bool = False  # also take the batches of iteration + 1 (``PullResult.next_batches``)

    def __post_init__(self) -> None:
        if not 1 <= self.batches <= MAX_PUSH_EVERY:
            raise InvalidRequest(
                f"A pull may ask for 1 to {MAX_PUSH_EVERY} batches, not {self.batches}."
            )

    def wait(
        self,
        c: Pulled,
        cond: threading.Condition,
        now: Callable[[], float],
        deadline: float,
        is_active: Callable[[], bool],
    ) -> PullResult:
        """The answer, once it can have one: waits on ``cond`` (the coordinator's, held by
        the caller) until ``deadline`` (``now``'s) while ``is_active``; the time waited is
        counted.

        Raises:
            Timeout: no answer by the deadline, or the caller went away.
            WrongIncarnation, UnknownWorker: rewound or evicted while waiting.
        """
        started = now()
        try:
            while (result := self.answer(c)) is None:
                remaining = deadline - now()
                if remaining <= 0 or not is_active():
                    raise self.timed_out(c, deadline - started)
                cond.wait(min(remaining, c.config.lease_seconds))
                self.still_meant(c)  # rewound (ABORTED) or evicted while waiting
            return result
        finally:
            c.counters.barrier_wait_seconds += now() - started

    def answer(self, c: Pulled) -> PullResult | None:
        """The pull's answer if it can have one now; None: it waits. The weights are the
        last published version's (``Applies.view``), and the clocks the policy reads are
        those whose pushes that version holds."""
        view = c.applies.view()
        if view is None:  # an apply runs and kept no copy: wait for its publish
            return None
        if c.members.finished:  # nothing left to compute: no staleness to speak of
            return answer(view, c.counters, None, None, (), True, self.sink)
        if not self.ready(c):
            return None
        wait = c.arrival.waits_for_batch  # for a batch, or the end
        taken = c.members.hand_out(self.worker_id, self.iteration, self.batches, wait)
        if taken is None:
            return None
        low = c.applies.low(c.membership)
        result = answer(view, c.counters, low, self.iteration, taken, sink=self.sink)
        if self.ahead and taken:  # the worker fetches their rows while this one computes
            after = c.members.hand_out(self.worker_id, self.iteration + 1, self.batches, False)
            result = dataclasses.replace(result, next_batches=after or ())
        if c.applies.reads is not None:  # what its push is computed on
            c.applies.reads.remember(self.worker_id, self.iteration, view.weights)
        return result

    def ready(self, c: Pulled) -> bool:
        """The run has started, no cut holds the pull back, and the policy allows it."""
        if not c.members.started:
            return False
        if c.cuts.full:
            return False  # the cuts taken wait for the disk: no more until one is written
        low = c.applies.low(c.membership)
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
