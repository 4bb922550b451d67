"""The server's optimizer on its own thread (``--optimizer-thread``): every push's
``Coordinator.push`` (its checks, the optimizer's step, the clocks) runs on one thread, in
arrival order; the threads that read requests (gRPC's pool, the control socket's
connections) hand their pushes over and wait for the result.

Off by default, by measurement (``bench scaling``, 2-core machine; docs/architecture.md): the hand-over adds
two thread wake-ups a push, 0.02-0.12 ms of the server's CPU; 2 workers under async train
20% slower (44k against 55-57k samples/s) and under sync as fast (43-45k against 42-44k).
In CPython the optimizer holds the GIL between its kernels, so a thread of its own
overlaps nothing that the request threads could not.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class _Job:
    __slots__ = ("fn", "args", "done", "result", "error")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]):
        self.fn, self.args = fn, args
        self.done = threading.Lock()
        self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None


def call(fn: Callable[..., T], *args: Any) -> T:
    """``Applier.run`` without the thread: ``fn(*args)`` here."""
    return fn(*args)


class Applier:
    """``run(fn, *args)`` calls ``fn(*args)`` on the applier's thread and returns its result
    (or raises its exception) to the caller."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # a job is queued before the end, or runs here
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="ps-applier", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        job = _Job(fn, args)
        with self._lock:
            if self._closed:  # the server is stopping: no thread to hand over to
                return fn(*args)
            self._jobs.put(job)
        job.done.acquire()
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[no-any-return]

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.result = job.fn(*job.args)
            except BaseException as exc:  # handed to the caller
                job.error = exc
            job.done.release()

    def close(self) -> None:
        """Finish the pushes handed over so far, then end the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        self._thread.join()
