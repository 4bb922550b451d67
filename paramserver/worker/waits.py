"""Retries' backoff (``Backoff``: how long between tries of a call that found no server,
and when to give up), and waits said aloud: a worker whose call waits says so every
``EVERY`` seconds, for whom and why, instead of staying silent until its deadline.

``Waits`` records the calls of one session that block on the server (a pull held for
slower workers or for a run that has not started) and says which are due a report;
``explain`` turns the server's status into the reason. The heartbeat thread asks and logs
(``worker/session.py``). Pure: the clock (and the backoff's random source) is injected,
so a test drives a whole outage without sleeping.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from paramserver._proto import paramserver_pb2 as pb

# Capped exponential backoff with full jitter, from 0.1 s up to 2 s between tries.
FIRST = 0.1
CAP = 2.0


@dataclass
class Backoff:
    """Delays for successive retries and the moment to stop retrying.

    Args:
        budget: seconds from the first failure after which ``expired`` says give up.
        first, cap: the first delay's upper bound, and the largest.
        now: a monotonic clock.
        rng: a source of uniform numbers in [0, 1).
    """

    budget: float
    first: float = FIRST
    cap: float = CAP
    now: Callable[[], float] = time.monotonic
    rng: Callable[[], float] = field(default=random.random)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (0 first): uniform in
        [0, min(cap, first * 2**attempt))."""
        return self.rng() * min(self.cap, self.first * 2 ** min(attempt, 62))

    def expired(self, since: float) -> bool:
        """Whether failures that began at ``since`` (a ``now()`` reading) have lasted the
        whole budget."""
        return self.now() - since >= self.budget


EVERY = 10.0  # seconds between two reports of the same wait


@dataclass
class Wait:
    what: str  # "the pull of iteration 3 from host:port"
    since: float
    reported: float  # when it was last reported (``since`` before the first report)


class Waits:
    """The calls in progress that may wait long; thread-safe."""

    def __init__(self, every: float | None = None, now: Callable[[], float] = time.monotonic):
        self.every = EVERY if every is None else every
        self.now = now
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._open: dict[int, Wait] = {}

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Around a call that may wait: reported while it lasts."""
        key = next(self._ids)
        start = self.now()
        with self._lock:
            self._open[key] = Wait(what, start, start)
        try:
            yield
        finally:
            with self._lock:
                del self._open[key]

    def due(self) -> list[tuple[str, float]]:
        """(what, seconds waited) of every wait not reported for ``every`` seconds; each
        is marked reported."""
        now = self.now()
        out = []
        with self._lock:
            for wait in self._open.values():
                if now - wait.reported >= self.every:
                    wait.reported = now
                    out.append((wait.what, now - wait.since))
        return out


def explain(st: pb.StatusResponse) -> str:
    """Why a pull waits, as the server's status says."""
    live = len(st.workers)
    if live < st.min_workers and st.version == 0:  # the server's own test, before a step
        return (
            f"the run has not started: {live} of {st.min_workers} workers are live "
            f"(training starts with {st.min_workers}: the server's --min-workers)"
        )
    if st.batches_total and st.batches_done >= st.batches_total:
        return "the run is over: every batch is applied"
    slowest = min((w.clock for w in st.workers), default=0)
    disk = (
        f"; checkpoint writes have failed for {st.checkpoint_failing_seconds:.0f}s and "
        f"{st.cuts_pending} cuts wait for the disk"
        if st.checkpoint_failing_seconds >= 0
        else ""
    )
    return (
        f"{live} workers are live under {st.policy}; the slowest live clock is {slowest} "
        f"(a pull waits for slower workers as the policy says){disk}"
    )
