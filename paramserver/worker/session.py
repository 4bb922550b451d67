"""A worker's membership of one server (shard): join, rejoin, heartbeat, leave.

States and transitions (``SessionState``)::

    JOINING --Join answered--------------------------> LIVE
    LIVE    --ABORTED (server restarted) or NOT_FOUND
              (lease dropped) on any call-----------> LOST
    LOST    --Join again under the same id----------> LIVE
    any     --close()-------------------------------> CLOSED

A LOST session's pushes in flight are dropped: the server's clock for this worker, returned
by the rejoin, says which pushes it holds, and the worker goes on from there. Calls that
find no server are retried with ``Backoff`` for up to the server timeout.

A session owns its ``Channel`` (``transport/client.py``): it makes it from the factory it is
given, offers payload buffers with each Join (``attach``) and closes it when it leaves.
"""

from __future__ import annotations

import enum
import logging
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import grpc

from paramserver._proto import paramserver_pb2 as pb
from paramserver.config.base import MAX_SECONDS
from paramserver.errors import (
    ClusterFull,
    ParamServerError,
    RejoinRequired,
    ServerUnavailable,
    Timeout,
    from_rpc_error,
)
from paramserver.transport.client import Channel, ChannelFactory, PayloadSpec
from paramserver.worker.waits import EVERY, Backoff, Waits, explain

log = logging.getLogger(__name__)
T = TypeVar("T")


class SessionState(enum.Enum):
    JOINING = "joining"
    LIVE = "live"
    LOST = "lost"
    CLOSED = "closed"


class Session:
    """One server's view of this worker: its id, rank, clock and incarnation there.

    Args:
        channels: makes the channel to an address (``transport.client.grpc_channels``, or a
            test's in-process one); the session owns and closes it.
        address: the server's host:port.
        name: shown in the server's status.
        rpc_timeout: deadline of Join, Push, Heartbeat and Leave.
        backoff: how long to retry while the server is unreachable.
        stop: set when the worker closes: retries end at once.
        sleep: waits for a retry's delay; returns True to stop (default: ``stop.wait``).
    """

    def __init__(
        self,
        channels: ChannelFactory,
        address: str,
        name: str,
        rpc_timeout: float,
        backoff: Backoff,
        stop: threading.Event,
        sleep: Callable[[float], bool] | None = None,
    ):
        self.address = address
        self.name = name
        self.rpc_timeout = rpc_timeout
        self.backoff = backoff
        self._stop = stop
        self._sleep = sleep or stop.wait
        self.state = SessionState.JOINING
        self.worker_id = ""
        self.past_ids: list[str] = []  # ids held on this server before, newest first
        self.rank = 0
        self.clock = 0
        self.incarnation = ""
        self.origin = ""  # the restart the server's state goes back to (JoinResponse.origin)
        self.lease_seconds = 0.0
        self.reply = pb.JoinResponse()
        self.rejoins = 0
        # this worker's clock before a restart that lost some of its pushes (``shards.rewound``)
        self.rewound: int | None = None
        # a join met a new incarnation (lost or not): the shards go back to its cut (attach.py)
        self.restarted = False
        self.first_clock: int | None = None  # the lowest clock joined at: its steps are after
        # the newest cut every shard has written, as their last pulls said (PullRequest)
        self.common_cut = 0
        self.ahead = False  # name the next iteration's batches too (PullRequest.ahead)
        self.channel: Channel = channels(address)
        self.waits = Waits(now=backoff.now)

    def pull_rows(self, request: pb.RowsRequest, timeout: float | None = None) -> pb.RowsResponse:
        """Rows of the sparse tables, on this session's channel (no retry: the caller's)."""
        return self.channel.pull_rows(request, timeout)

    # --- calls ------------------------------------------------------------------------

    def call(self, what: str, method: Any, request: Any, timeout: float | None = None) -> Any:
        """One call, its gRPC failure translated into a ParamServerError."""
        try:
            return method(request, timeout=timeout or self.rpc_timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err, f"{what} to {self.address}") from None

    def retrying(
        self, what: str, call: Callable[[], T], also: tuple[type[Exception], ...] = ()
    ) -> T:
        """``call()``, retried with backoff while the server is unreachable (or raises one of
        ``also``).

        Raises:
            ServerUnavailable: the server did not come back within the backoff's budget
                (``also``: the last such error, once the budget is spent).
            RejoinRequired: the session is LOST (and marked so).
            ParamServerError: any other failure, at once.
        """
        attempt, since, said = 0, None, 0.0
        while True:
            try:
                return call()
            except grpc.RpcError as err:
                exc = from_rpc_error(err, f"{what} to {self.address}")
            if isinstance(exc, RejoinRequired):
                self.lose(exc)
                raise exc
            if not isinstance(exc, (ServerUnavailable, *also)) or self._stop.is_set():
                raise exc
            if since is None:
                since = said = self.backoff.now()
                log.warning("%s; retrying for up to %.0fs", exc, self.backoff.budget)
            elif self.backoff.now() - said >= EVERY:
                said = self.backoff.now()
                log.warning(
                    "still failing after %.0fs (%s); retrying for %.0fs more (--server-timeout)",
                    said - since,
                    exc,
                    max(self.backoff.budget - (said - since), 0.0),
                )
            if self.backoff.expired(since) and not isinstance(exc, ServerUnavailable):
                raise type(exc)(
                    f"{exc} Still so after {self.backoff.budget:.0f}s (--server-timeout)."
                ) from None
            if self.backoff.expired(since):
                raise ServerUnavailable(
                    f"The server at {self.address} did not come back within "
                    f"{self.backoff.budget:.0f}s (--server-timeout); last error: {exc}"
                ) from None
            if self._sleep(self.backoff.delay(attempt)):
                raise exc
            attempt += 1

    # --- membership -------------------------------------------------------------------

    def join(self, request: pb.JoinRequest, retry: bool = False) -> pb.JoinResponse:
        """Join (or, with our id in ``request``, join again); LIVE once answered."""
        if retry and self._stop.is_set():  # closing: no member left behind after its Leave
            raise ServerUnavailable(f"Not joining {self.address} again: the worker is closing.")
        request.name = self.name
        request.worker_id = self.worker_id
        del request.past_ids[:]
        request.past_ids.extend(self.past_ids)
        # one id for this attempt and its retries: a retry after a lost reply gets that member
        request.join_id = uuid.uuid4().hex
        # a full cluster waits for a slot; a join past its deadline is retried (same join_id)
        reply = self.retrying(
            "rejoin" if retry else "join",
            lambda: self.channel.join(request, timeout=self.rpc_timeout),
            also=(ClusterFull, Timeout),
        )
        was = (self.worker_id, self.incarnation, self.clock)
        restarted = bool(was[1]) and reply.incarnation != was[1]
        lost = self.state is SessionState.LOST and restarted
        first = reply.clock if self.first_clock is None else self.first_clock
        if lost and first < was[2] and reply.clock < was[2]:  # behind its pushes: say so once
            self.rewound = was[2]
        self.first_clock = min(first, reply.clock)
        self.restarted |= restarted
        if was[0] and was[0] != reply.worker_id:  # remembered: a rewind may bring it back
            self.past_ids = [was[0], *[i for i in self.past_ids if i != reply.worker_id]][:8]
        self.reply = reply
        self.worker_id = reply.worker_id
        self.rank = reply.rank
        self.clock = reply.clock
        self.incarnation = reply.incarnation
        self.origin = reply.origin or reply.incarnation  # servers before origins: their own
        self.lease_seconds = reply.lease_seconds
        self.common_cut = 0  # what the shards said before may not hold after a rewind
        if restarted or self.state is SessionState.LOST:
            # a restart no heartbeat had seen: a worker's second join met another incarnation
            self.rejoins += self.state is SessionState.LOST
            log.warning(
                "%s %s (incarnation %s, was %s) as %s (was %s) at clock %d (was %d)",
                "rejoined" if self.state is SessionState.LOST else "restarted between joins:",
                self.address,
                self.incarnation,
                was[1],
                self.worker_id,
                was[0],
                self.clock,
                was[2],
            )
        self.state = SessionState.LIVE
        return reply

    def attach(
        self,
        request: pb.JoinRequest,
        spec: PayloadSpec,
        retry: bool = False,
        check: Callable[[pb.JoinResponse], None] | None = None,
    ) -> pb.JoinResponse:
        """``join``, offering buffers for ``spec``'s payloads, and open the channel's payload
        path over what the server accepted; ``check`` may refuse the reply (raising), and
        then nothing is opened."""
        self.channel.offer(request, spec)
        try:
            reply = self.join(request, retry)
            if check is not None:
                check(reply)
        except BaseException:
            self.channel.withdraw()
            raise
        self.channel.open(reply)
        return reply

    def catch_up(self, asked: int, answered: pb.PullHeader) -> None:
        """A pull of ``asked`` answered for a later iteration (a late worker under
        ``--backup-workers``): the clock moves there."""
        if answered.iteration > asked and answered.iteration > self.clock:
            log.debug("caught up from iteration %d to %d", self.clock, answered.iteration)
            self.clock = answered.iteration

    def lose(self, exc: BaseException) -> None:
        """The server restarted or dropped this worker: join again before the next pull."""
        if self.state is SessionState.LIVE:
            log.warning("%s; joining again", exc)
            self.state = SessionState.LOST

    @property
    def lost(self) -> bool:
        return self.state is SessionState.LOST

    def heartbeat_once(self, timeout: float) -> None:
        """One heartbeat: renews the lease; marks the session LOST if the server says so."""
        if self.state is not SessionState.LIVE:
            return
        try:
            self.call(
                "heartbeat",
                self.channel.heartbeat,
                pb.HeartbeatRequest(worker_id=self.worker_id, incarnation=self.incarnation),
                timeout=timeout,
            )
        except RejoinRequired as exc:
            self.lose(exc)
        except ParamServerError as exc:
            log.info("%s", exc)

    def report_waits(self, timeout: float) -> None:
        """Log each call of this session that has waited another ``waits.EVERY`` seconds
        (a pull held for slower workers, or for a run that has not started), with the
        reason the server's status gives within ``timeout`` seconds (the heartbeat
        thread's: never long enough to starve the lease)."""
        for what, waited in self.waits.due():
            try:
                asked = self.call("status", self.channel.status, pb.StatusRequest(), timeout)
                why = explain(asked)
            except ParamServerError as exc:
                why = f"the server's status did not come: {exc}"
            log.info("%s has waited %.0fs: %s", what, waited, why)

    # --- payload requests ---------------------------------------------------------------

    def push_header(
        self,
        iteration: int,
        samples: int,
        loss: float,
        empty: bool,
        rows: Iterable[pb.RowGradients] = (),
        row_cache: tuple[int, int] = (0, 0),
        batches: Iterable[int] = (),
        idle: Iterable[int] = (),
        norm_sq: float | None = None,
    ) -> pb.PushHeader:
        header = pb.PushHeader(
            batches=() if empty else batches,
            idle=() if empty else idle,
            worker_id=self.worker_id,
            iteration=iteration,
            samples=samples,
            loss=loss,
            incarnation=self.incarnation,
            empty=empty,
            shard=self.reply.shard,
            rows=rows,
            row_cache_hits=row_cache[0],
            row_cache_misses=row_cache[1],
        )
        if norm_sq is not None and not empty:  # the servers clip it by this norm
            header.norm_sq = norm_sq
        return header

    def pull_request(self, iteration: int, batches: int) -> pb.PullRequest:
        return pb.PullRequest(
            worker_id=self.worker_id,
            iteration=iteration,
            incarnation=self.incarnation,
            batches=batches,
            common_cut=self.common_cut,
            ahead=self.ahead,
        )

    def status(self) -> pb.StatusResponse:
        """The server's Status."""
        return self.call("status", self.channel.status, pb.StatusRequest())  # type: ignore[no-any-return]

    def close(self, finished: bool = False) -> None:
        """Leave the run (best effort; ``finished``: because the run is over), then close the
        channel."""
        if self.state is SessionState.CLOSED:
            return
        try:
            if self.worker_id:
                request = pb.LeaveRequest(
                    worker_id=self.worker_id, finished=finished, incarnation=self.incarnation
                )
                self.call("leave", self.channel.leave, request, 5)
        except ParamServerError as exc:
            log.warning("%s", exc)
        finally:
            self.state = SessionState.CLOSED
            self.channel.close()


class Heartbeats:
    """Threads that renew every session's lease from its join on (a worker building its model
    after joining kept none: a chaos run's 2 s leases dropped every worker at start), each a
    third of the shortest lease; one a session, so that a server that does not answer (each
    call waits out its timeout) holds back no other's heartbeats (chaos: a shard paused for
    3.7 s made the other drop two workers). ``once``: a round of every session's."""

    def __init__(self, sessions: list[Session], stop: threading.Event):
        self.sessions = sessions
        self._stop = stop
        self._threads = [
            threading.Thread(target=self._loop, args=(s,), name=f"ps-heartbeat-{i}", daemon=True)
            for i, s in enumerate(sessions)
        ]
        self.failures = 0  # rounds that raised (each logged with its traceback)

    def interval(self) -> float:
        """A third of the shortest lease of the sessions joined (a quarter second before),
        at most ``MAX_SECONDS``: a lease comes from the server, and a wait longer than
        threading takes would end the thread."""
        leases = [s.lease_seconds for s in self.sessions if s.lease_seconds > 0]
        return min(max(min(leases) / 3, 0.05), MAX_SECONDS) if leases else 0.25

    def once(self) -> None:
        for s in self.sessions:
            self._beat(s)

    def _beat(self, s: Session) -> None:
        s.heartbeat_once(2 * self.interval())
        s.report_waits(2 * self.interval())

    def _loop(self, s: Session) -> None:
        while not self._stop.wait(self.interval()):
            try:
                self._beat(s)
            except Exception:  # noqa: BLE001 - the thread must live on: logged, counted
                self.failures += 1
                if self.failures == 1 or self.failures % 100 == 0:  # loud, not a flood
                    log.exception("heartbeat round failed (%d so far); retrying", self.failures)

    def start(self) -> Heartbeats:
        for t in self._threads:
            t.start()
        return self

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)
