"""gRPC health checking that a client without the token cannot use to starve the workers.

The health service answers without the token (a probe carries no secret), so it must hold
nothing that workers need, for no longer than a bounded time:

- its calls, and the refusals of calls without the token, run on ``SIDE_POOL``: a few
  threads of their own, never the workers' pool, and never counted among the server's
  concurrent calls (``maximum_concurrent_rpcs``), so however many of them wait, a worker's
  call is never refused or queued behind them;
- ``Watch`` holds no thread while it watches (gRPC's non-blocking streams), at most
  ``MAX_WATCHES`` are open at once (one more is refused with RESOURCE_EXHAUSTED), and each
  ends after ``WATCH_SECONDS`` (``expire``, called by the server's reaper; a client then
  watches again).

At most ``SIDE_THREADS`` request bodies of unauthenticated calls are read at a time, each at
most the server's receive limit (a refused call's body is not read at all).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health

log = logging.getLogger(__name__)

SIDE_THREADS = 2
MAX_WATCHES = 16
WATCH_SECONDS = 300.0


class UncountedPool(futures.ThreadPoolExecutor):
    """A thread pool whose calls the gRPC server does not count as running: ``submit``
    queues the work and hands back a future that is already done (gRPC counts a call as
    running until the future it got is done)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
        super().submit(fn, *args, **kwargs)
        done: futures.Future[Any] = futures.Future()
        done.set_result(None)
        return done


# One pool for every server of the process (the health servicer's methods carry it as a
# class attribute, as grpc_health does for Watch).
SIDE_POOL = UncountedPool(max_workers=SIDE_THREADS, thread_name_prefix="ps-health")


def on_side_pool(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Tag a handler function so that the gRPC server runs it on ``SIDE_POOL``."""
    fn.experimental_thread_pool = SIDE_POOL  # type: ignore[attr-defined]
    return fn


class BoundedHealth(health.HealthServicer):
    """grpc_health's servicer with its calls on ``SIDE_POOL`` and its watches bounded."""

    def __init__(
        self,
        max_watches: int = MAX_WATCHES,
        watch_seconds: float = WATCH_SECONDS,
        now: Callable[[], float] = time.monotonic,
    ):
        super().__init__(experimental_non_blocking=True, experimental_thread_pool=SIDE_POOL)
        self.max_watches = max_watches
        self.watch_seconds = watch_seconds
        self._now = now
        self._watches: dict[int, tuple[float, Callable[[Any], None]]] = {}
        self._next = 0
        self._watch_lock = threading.Lock()
        self.refused_watches = 0
        self._known: set[str] = set()
        self.absent: dict[str, str] = {}  # a service this server lacks: why, for NOT_FOUND

    def set(self, service: str, status: Any) -> None:
        self._known.add(service)
        super().set(service, status)

    def unknown(self, service: str) -> str:
        """Why ``service`` has no health here, in words (grpc_health answers NOT_FOUND with
        an empty text)."""
        known = ", ".join(repr(s) for s in sorted(self._known)) or "none"
        why = self.absent.get(service, "")
        named = (
            repr(service)
            if len(service) <= 80
            else f"{service[:70]!r}... ({len(service)} characters)"
        )
        return f"No health service {named} here{': ' + why if why else ''}; it has {known}."

    @on_side_pool
    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        if request.service not in self._known:
            context.abort(grpc.StatusCode.NOT_FOUND, self.unknown(request.service))
        return super().Check(request, context)

    def Watch(  # noqa: N802
        self,
        request: Any,
        context: grpc.ServicerContext,
        send_response_callback: Callable[[Any], None] | None = None,
    ) -> Any:
        if send_response_callback is None:  # a blocking stream would hold a thread
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch needs a non-blocking server.")
            raise AssertionError("abort raises")
        with self._watch_lock:
            if len(self._watches) >= self.max_watches:
                self.refused_watches += 1
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.max_watches} health watches are open; use Check, or watch later.",
                )
            key = self._next
            self._next += 1
            self._watches[key] = (self._now(), send_response_callback)
        if not context.add_callback(lambda: self._forget(key)):
            self._forget(key)
        return super().Watch(request, context, send_response_callback)  # an unknown one: waits

    def _forget(self, key: int) -> None:
        with self._watch_lock:
            self._watches.pop(key, None)

    @property
    def watching(self) -> int:
        with self._watch_lock:
            return len(self._watches)

    def expire(self) -> int:
        """End the watches older than ``watch_seconds`` (their streams close with OK).
        Returns how many."""
        now = self._now()
        with self._watch_lock:
            old = [
                k for k, (since, _) in self._watches.items() if now - since >= self.watch_seconds
            ]
            ends = [self._watches.pop(k)[1] for k in old]
        for end in ends:
            try:
                end(None)
            except Exception:  # noqa: BLE001 - a stream already gone: nothing to end
                log.debug("a health watch had ended already", exc_info=True)
        return len(ends)
