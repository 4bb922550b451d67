"""How a step's payloads move between the worker and every shard.

Three ways, chosen by ``step_mode`` (each driven by its ``Exchange`` in ``stages.py``):

- BLOCKING (overlap off): push this step's gradient and pull the next weights, one round
  trip per shard (one PushPull through shared memory), before the model computes again.
- OVERLAPPED (overlap on, streams or sync): the push goes to a background thread per shard
  while the pull for the next iteration waits for the policy.
- PREFETCHING (overlap on, shared memory, a policy other than sync): the weights for the
  next iteration were fetched while this one computed; the push of step t and the fetch
  for step t+2 go out together while step t+1 computes.

Every shard's calls run at once (a thread per shard); a shard's background calls run in
order on its own thread, so its server sees its pushes in clock order. Background failures
are kept and raised by the next step; a lost session (the server restarted or dropped the
lease) only marks the session, and the worker joins again before its next pull.

A push of server-handed batches to several shards reaches shard 0 last (``Landing``):
shard 0 counts the batches done, so a batch it counts is on every shard, and one it hands
out again (its worker died between the calls) is found applied where it landed
(``server/bookkeeping/ledger.py``). When a shard did not take the push (it restarted, or dropped the
lease), shard 0 gets an empty push, which gives the batches back to the queue.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec.idle import pairs
from paramserver.errors import RejoinRequired, Timeout
from paramserver.worker.norm_relay import NormRelay
from paramserver.worker.pushes import Landed, Landing, StagedPush
from paramserver.worker.session import Session

T = TypeVar("T")
log = logging.getLogger(__name__)


class StepMode(enum.Enum):
    BLOCKING = "blocking"
    OVERLAPPED = "overlapped"
    PREFETCHING = "prefetching"


def step_mode(overlap: bool, shm: bool, synchronous: bool) -> StepMode:
    """How steps move: prefetch needs shared memory on every shard and a policy that lets a
    worker compute iteration t+1 before its push of t has landed."""
    if not overlap:
        return StepMode.BLOCKING
    if shm and not synchronous:
        return StepMode.PREFETCHING
    return StepMode.OVERLAPPED


class Pipeline:
    """The calls of a step over ``sessions``: foreground fan-out, background pushes in
    order, push slots, and the prefetch in flight.

    Args:
        sessions: one per shard, in shard order; their channels' payload paths are open.
        slots: push slots (pushes in flight at most).
        rpc_timeout: deadline of a push.
        barrier_timeout: deadline of a pull, which may wait for slower workers.
    """

    def __init__(
        self, sessions: Sequence[Session], slots: int, rpc_timeout: float, barrier_timeout: float
    ):
        self.sessions = list(sessions)
        self.rpc_timeout = rpc_timeout
        self.barrier_timeout = barrier_timeout
        n = len(self.sessions)
        self._fg = ThreadPoolExecutor(n, thread_name_prefix="ps-shard") if n > 1 else None
        self._bg = [ThreadPoolExecutor(1, thread_name_prefix=f"ps-push{i}") for i in range(n)]
        self._free = list(range(slots))
        self._inflight: deque[tuple[int, list[Future[None]]]] = deque()
        self._ahead: list[Future[pb.PullHeader | None]] | None = None
        self.error: BaseException | None = None
        self._closed = threading.Event()
        self.landed = Landed()  # the batches of the pushes shard 0 took: --batch-log's
        relays = any(s.reply.relay_norm for s in self.sessions)  # --clip-grad-norm, shards
        self.relay = NormRelay(self.sessions, self._closed) if relays else None

    def _took(self, s: Session, staged: StagedPush) -> None:
        if s is self.sessions[0]:  # shard 0 counts the batches done
            self.landed.took(staged)

    def _landing(self, staged: StagedPush | None) -> Landing | None:
        """A push of server-handed batches to several shards goes to shard 0 last."""
        if staged is None or not staged.batches or len(self.sessions) < 2:
            return None
        return Landing(len(self.sessions), self._closed)

    # --- fan-out ----------------------------------------------------------------------

    def each(self, fn: Callable[[Session], T]) -> list[T]:
        """``fn`` on every session at once; the first failure is raised after all end."""
        return self.each_indexed(lambda _, s: fn(s))

    def each_indexed(self, fn: Callable[[int, Session], T]) -> list[T]:
        """``fn(i, session i)`` on every session at once."""
        if self._fg is None:
            return [fn(0, self.sessions[0])]
        futures = [self._fg.submit(fn, i, s) for i, s in enumerate(self.sessions)]
        for f in futures:
            f.exception()
        return [f.result() for f in futures]

    def _background(
        self, i: int, fn: Callable[[], T], landing: Landing | None = None
    ) -> Future[T | None]:
        """``fn`` on shard i's background thread; a lost session yields None, any other
        failure is kept in ``error`` (raised by the worker's next step) and yields None.
        ``landing``: shard i > 0 marks there whether it took the push (``fn`` marks True
        once it has; anything else marks False)."""

        def run() -> T | None:
            try:
                if self.error is not None or self.sessions[i].lost:
                    return None  # what follows a failure or a lost server is dropped
                try:
                    return fn()
                except RejoinRequired:
                    return None  # the session is marked lost; the next pull joins again
                except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                    self.error = self.error or exc
                    return None
            finally:
                if landing is not None and i > 0:
                    landing.mark(i, False)  # unless fn marked True already

        return self._bg[i].submit(run)

    def check(self) -> None:
        """Raise the first background failure, if any (the worker's next step does)."""
        if self.error is not None:
            raise self.error

    # --- slots ------------------------------------------------------------------------

    def take_slot(self) -> int:
        """A free push slot, waiting for the oldest push in flight if there is none."""
        while not self._free:
            slot, futures = self._inflight.popleft()
            for f in futures:
                f.result()
            self._free.append(slot)
        return self._free.pop()

    def try_take_slot(self) -> int | None:
        """A push slot free now (the oldest push in flight's, if it was answered without an
        error), or None; never waits, never raises (a gradient hook asks during backward)."""
        if not self._free and self._inflight:
            slot, futures = self._inflight[0]
            if all(f.done() and f.exception() is None for f in futures):
                self._inflight.popleft()
                self._free.append(slot)
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)

    # --- calls ------------------------------------------------------------------------

    def _header(self, s: Session, staged: StagedPush, iteration: int) -> pb.PushHeader:
        """``staged``'s header for ``s``'s shard: its rows' messages made by the channel
        (their values in the slot's part of a shared segment, where there is one). The
        relay (if any) relays the round's norm."""
        if self.relay is not None:
            self.relay.pushed(iteration)
        rows = s.channel.row_messages(staged.rows.get(s.reply.shard, ()), staged.slot)
        idle = staged.idle.get(s.reply.shard, ())
        return s.push_header(
            iteration,
            staged.samples,
            staged.loss,
            staged.empty,
            rows,
            staged.row_cache,
            staged.batches,
            pairs(idle),
            staged.norm_sq,
        )

    def _push(self, s: Session, staged: StagedPush, iteration: int) -> pb.PushResponse:
        header = self._header(s, staged, iteration)
        channel = s.channel
        # A push past its deadline (a link down, a server stalled) is retried like one that
        # found no server: a repeat is acknowledged as a duplicate, never applied twice.
        answered = s.retrying(
            f"push of iteration {iteration}",
            lambda: channel.push(header, staged.slot, self.rpc_timeout),
            also=(Timeout,),
        )
        self._took(s, staged)
        return answered

    def push_empty(self, s: Session, iteration: int) -> pb.PushResponse:
        """An empty push of ``iteration`` to ``s`` now (no gradient, no batch: it counts for
        the worker's clock there), as ``shards.align_clocks`` sends."""
        return self._push(s, StagedPush(0, (iteration,), empty=True), iteration)

    def _pull(self, s: Session, iteration: int, batches: int) -> pb.PullHeader:
        if self.relay is not None:  # it waits for the round before: relay it if need be
            self.relay.pushed(iteration - 1)
        request = s.pull_request(iteration, batches)
        channel = s.channel
        with s.waits.waiting(f"The pull of iteration {iteration} from {s.address}"):
            answered = s.retrying(
                f"pull of iteration {iteration}",
                lambda: channel.pull(request, self.barrier_timeout),
            )
        s.catch_up(iteration, answered)
        return answered

    def _push_pull(
        self, s: Session, staged: StagedPush, iteration: int, pull: int, batches: int
    ) -> pb.PullHeader:
        header = self._header(s, staged, iteration)
        request = s.pull_request(pull, batches)
        channel = s.channel
        with s.waits.waiting(f"The pull of iteration {pull} from {s.address}"):
            answered = s.retrying(
                f"push of iteration {iteration} and pull of {pull}",
                lambda: channel.push_pull(header, staged.slot, request, self.barrier_timeout),
            )
        self._took(s, staged)
        s.catch_up(pull, answered)
        return answered

    def pull(self, batches: int) -> list[pb.PullHeader]:
        """Every shard's weights for its session's clock, into its channel's buffer.

        Raises:
            RejoinRequired: a session is lost; join it again and retry.
        """
        return self.each(lambda s: self._pull(s, s.clock, batches))

    def push_pull(self, staged: StagedPush, batches: int) -> list[pb.PullHeader]:
        """Push ``staged`` and pull each shard's next weights (at its clock), one round trip
        a shard; the slot is free again afterwards.

        Raises:
            RejoinRequired: a session is lost; join it again and pull.
        """
        try:
            if self._landing(staged) is None:
                return self.each_indexed(
                    lambda i, s: self._push_pull(s, staged, staged.iterations[i], s.clock, batches)
                )
            return self._push_pull_in_order(staged, batches)
        finally:
            self.release(staged.slot)

    def _push_pull_in_order(self, staged: StagedPush, batches: int) -> list[pb.PullHeader]:
        """Push to every shard but 0, then to shard 0 (empty if one of them did not take
        it) with its pull, while the others pull."""
        pool = self._fg
        assert pool is not None
        pushes = [
            pool.submit(self._push, s, staged, staged.iterations[i])
            for i, s in enumerate(self.sessions)
            if i > 0
        ]
        lost = next((e for f in pushes if (e := f.exception()) is not None), None)
        if lost is not None and not isinstance(lost, RejoinRequired):
            raise lost  # shard 0 not told: the batches go back when this worker's lease ends
        if lost is not None:  # give the batches back, then join the lost shard again
            self._push(self.sessions[0], staged.emptied(), staged.iterations[0])
            raise lost

        def then(i: int, s: Session) -> pb.PullHeader:
            if i == 0:
                return self._push_pull(s, staged, staged.iterations[0], s.clock, batches)
            return self._pull(s, s.clock, batches)

        return self.each_indexed(then)

    def push_background(self, staged: StagedPush) -> None:
        """Push ``staged`` to every shard from the background; its slot frees when done."""
        landing = self._landing(staged)
        futures = [
            self._background(i, self._pusher(i, staged, landing), landing)
            for i in range(len(self.sessions))
        ]
        self._inflight.append((staged.slot, futures))  # type: ignore[arg-type]

    def _pusher(
        self, i: int, staged: StagedPush, landing: Landing | None
    ) -> Callable[[], pb.PushResponse]:
        s, iteration = self.sessions[i], staged.iterations[i]

        def push() -> pb.PushResponse:
            if landing is not None and i == 0:
                return self._push(s, staged if landing.wait() else staged.emptied(), iteration)
            reply = self._push(s, staged, iteration)
            if landing is not None:
                landing.mark(i, True)
            return reply

        return push

    def _fetcher(
        self, i: int, staged: StagedPush | None, batches: int, landing: Landing | None
    ) -> Callable[[], pb.PullHeader]:
        """Shard i's prefetch: push ``staged`` (if any) and pull its clock + 1; in order
        (``landing``), a shard but 0 pushes, marks and then pulls, and shard 0 waits."""
        s = self.sessions[i]
        after = s.clock + 1
        if staged is None:
            return lambda: self._pull(s, after, batches)
        iteration = staged.iterations[i]
        if landing is None:
            return lambda: self._push_pull(s, staged, iteration, after, batches)
        if i == 0:
            return lambda: self._push_pull(
                s, staged if landing.wait() else staged.emptied(), iteration, after, batches
            )

        def push_then_pull() -> pb.PullHeader:
            self._push(s, staged, iteration)
            landing.mark(i, True)
            return self._pull(s, after, batches)

        return push_then_pull

    def start_ahead(self, staged: StagedPush | None, batches: int) -> None:
        """In the background: push ``staged`` (if any) and fetch every shard's weights for
        its clock + 1."""
        landing = self._landing(staged)
        futures = [
            self._background(i, self._fetcher(i, staged, batches, landing), landing)
            for i in range(len(self.sessions))
        ]
        self._ahead = futures
        if staged is not None:
            self._inflight.append((staged.slot, futures))  # type: ignore[arg-type]

    def ahead_first(self) -> Future[pb.PullHeader | None] | None:
        """Shard 0's prefetch in flight (its header names the batches to come), if any."""
        return self._ahead[0] if self._ahead else None

    def wait_ahead(self) -> list[pb.PullHeader] | None:
        """The prefetch in flight, landed: every shard's header (weights in its buffer), or
        None when there was none or a shard's failed."""
        futures, self._ahead = self._ahead, None
        if futures is None:
            return None
        headers = [f.result() for f in futures]
        if any(h is None for h in headers):
            return None
        return headers  # type: ignore[return-value]

    def flush(self) -> None:
        """Wait for every background call to end (failures stay in ``error``)."""
        self.wait_ahead()
        while self._inflight:
            slot, futures = self._inflight.popleft()
            for f in futures:
                f.result()
            self._free.append(slot)

    def settle(self) -> None:
        """Before the worker leaves: the rounds it pushed applied (their norms relayed), or
        the push's deadline passed."""
        if self.relay is not None and not self.relay.settle(self.rpc_timeout):
            log.warning("left before round %d's norm was relayed", self.relay.wanted)

    def shutdown(self, wait: bool) -> None:
        self._closed.set()
        for pool in [*self._bg, *([self._fg] if self._fg else [])]:
            pool.shutdown(wait=wait, cancel_futures=not wait)
