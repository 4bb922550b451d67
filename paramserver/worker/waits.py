"""Waits said aloud: a worker whose call waits says so every ``EVERY`` seconds, for whom
and why, instead of staying silent until its deadline.

``Waits`` records the calls of one session that block on the server (a pull held for
slower workers or for a run that has not started) and says which are due a report;
``explain`` turns the server's status into the reason. The heartbeat thread asks and logs
(``worker/session.py``). Pure: the clock is injected.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from paramserver._proto import paramserver_pb2 as pb

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
