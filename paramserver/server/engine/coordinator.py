"""The server's state machine: membership, staleness policy and store behind one lock.

No gRPC here: the servicer decodes requests, calls these methods and encodes replies.
Waiting (for a barrier) happens on a condition variable that every state change notifies;
whether a waiting pull may have its answer, and the answer, are ``pulls``'s (``Pull``).

Its parts own their state (only this module and ``state_io`` assign the coordinator's
fields): ``members`` (who is in the run, their clocks and batches), ``arrival`` (what of a
push reaches the model and when: a sync round or on arrival, chosen once from the policy)
and ``saving`` (cuts waiting for the disk, the checkpointer's writes). Its state in and out (the cuts, a
``CoordinatorSnapshot`` taken by ``checkpoint_state``, one taken over at the start,
``snapshot=``, or by a rewind) is its base class's, ``state_io.StateInOut``."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from paramserver.codec.layout import Manifest
from paramserver.codec.rows import RowGradients
from paramserver.config import ServerConfig
from paramserver.errors import InvalidRequest, WrongIncarnation
from paramserver.policy.staleness import Policy
from paramserver.server.bookkeeping.batch_queue import BatchQueue
from paramserver.server.bookkeeping.buffers import SharedBuffers
from paramserver.server.bookkeeping.compensation import Reads
from paramserver.server.bookkeeping.leases import Member
from paramserver.server.bookkeeping.snapshot import CoordinatorSnapshot
from paramserver.server.bookkeeping.status import Counters, ServerStatus, server_status
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.engine.answers import PullResult, PushResult, answer
from paramserver.server.engine.arrival import Arrival
from paramserver.server.engine.checks import check_push
from paramserver.server.engine.dense_apply import Applies
from paramserver.server.engine.members import Members
from paramserver.server.engine.pulls import Pull
from paramserver.server.engine.saving import Saving
from paramserver.server.engine.state_io import StateInOut
from paramserver.sparse.tableset import TableSet, complete_all

log = logging.getLogger(__name__)


class Coordinator(StateInOut):
    """Serialises every decision of the server; thread-safe.

    Args:
        store: the flat model (this shard's range) and its optimizer.
        tables: this shard's rows of the model's sparse tables; None: the model has none.
        frozen: the frozen parameters, constants a checkpoint holds beside the run's state.
        model_numel: the whole model's size (default: the store's); ``shard_offset``:
            where this server's range starts (``--shard I/S``).
        snapshot: a state to go on from (a checkpoint's, or a cut's): the server resumes
            where it was taken, as a new incarnation.
    """

    def __init__(
        self,
        config: ServerConfig,
        store: ParameterStore,
        now: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        *,
        tables: TableSet | None = None,
        frozen: dict[str, Any] | None = None,
        model_numel: int | None = None,
        shard_offset: int = 0,
        snapshot: CoordinatorSnapshot | None = None,
    ):
        self.config = config
        self.policy: Policy = config.parsed_policy
        self.store = store
        self.manifest: Manifest = store.manifest
        self.tables = tables
        self.frozen: dict[str, Any] = frozen or {}
        self.model_numel = store.manifest.numel if model_numel is None else model_numel
        self.shard_offset = shard_offset
        self.incarnation = uuid.uuid4().hex[:12]
        self.origin = self.incarnation  # JoinResponse.origin: its own, until a rewind
        self.started_at, self._now, self._wall = now(), now, wall
        self._cond = threading.Condition()
        self.counters = Counters()
        self.buffers = SharedBuffers(self.manifest)
        self.members = Members(config, now)
        store.progress = lambda: self.members.progress()  # --lr-schedule-by batches
        self.applies = Applies(store, self.counters, self._cond, now, config.coalesce == "on")
        self.applies.reads = Reads.of(config.compensation(tables is not None), store.n_params)
        self.applies.published = self._published
        self.arrival: Arrival = self._arrival(None)
        self.saving = Saving(self._cond, self.arrival.in_rounds)
        if snapshot is not None:
            self._take_over(snapshot)
            with self._cond:  # --forget-workers
                self._after_leaving(self.members.forgotten())

    # --- its parts, as status and the tests read them -----------------------------------

    @property
    def queue(self) -> BatchQueue | None:
        return self.members.queue

    ledger = property(lambda self: self.arrival.ledger)  # the batches this shard applied
    saves = property(lambda self: self.saving.saves)  # Saves

    def check_incarnation(self, incarnation: str) -> None:
        """A call meant for an earlier incarnation of the server (a restart, or a rewind to
        a cut) is refused (ABORTED)."""
        if incarnation and incarnation != self.incarnation:
            raise WrongIncarnation(
                f"This server is incarnation {self.incarnation}, not {incarnation}: it restarted "
                "since the worker joined. Join again."
            )

    # --- membership -------------------------------------------------------------------

    def join(
        self, name: str, worker_id: str = "", train_samples: int = 0, join_id: str = "",
        past_ids: Sequence[str] = (),
    ) -> Member:  # fmt: skip
        """Admit a worker, or take back one that knows its id (or one of its ``past_ids``), or
        a retry of a join attempt (``join_id``): ``Members.join`` (ClusterFull: ``--workers``
        are live; InvalidRequest: its data set is not the one the run's batches come from)."""
        with self._cond:
            start = self.arrival.start_clock()
            member = self.members.join(name, worker_id, train_samples, join_id, start, past_ids)
            self._cond.notify_all()
            return member

    def heartbeat(self, worker_id: str) -> int:
        with self._cond:
            self.membership.touch(worker_id)
            return self.store.version

    def leave(
        self, worker_id: str, finished: bool = False, incarnation: str = "", returning: bool = False
    ) -> bool:
        """A worker leaves; whether it was let (``returning``, one that joins again under its
        id, leaves only the incarnation it names: ``LeaveRequest.returning``)."""
        with self._cond:
            current = incarnation == self.incarnation  # ``finished`` counts then only
            if returning and not current:
                return False
            self._after_leaving(self.members.leave(worker_id, finished, current))
            if not self.membership.members and self.arrival.between_rounds:
                end = self.cuts.at_end(self.rounds)  # the last one left: the run's end
                if end is not None:
                    self.saving.take(end, self._snapshot(end))
            return True

    def expire_leases(self, paused: float = 0.0, at: float | None = None) -> list[Member]:
        """Drop workers whose lease ran out: no barrier waits on them (``Members.expire``)."""
        with self._cond:
            dead = self.members.expire(paused, at)
            self._after_leaving(dead)
            return dead

    def _after_leaving(self, gone: list[Member]) -> None:
        # The batches they took and did not push go back to the queue for someone else.
        if not gone:
            return
        self.members.release(gone)
        live = self.membership.live_ids()
        self.buffers.keep_only(live)
        self._settled(self.arrival.left(live))
        self._cond.notify_all()

    # --- push -------------------------------------------------------------------------

    def accept_header(self, worker_id: str, row_cache: tuple[int, int] = (0, 0)) -> None:
        """A push header the servicer found well-formed renews the lease before its payload
        is read (a large payload takes a while), and notes the worker's row cache.

        Raises:
            UnknownWorker: ``worker_id`` holds no lease.
        """
        with self._cond:
            self.membership.touch(worker_id).row_cache = row_cache

    def push(
        self,
        worker_id: str,
        iteration: int,
        grad: np.ndarray | None,
        samples: int,
        loss: float,
        incarnation: str = "",
        rows: Iterable[RowGradients] = (),
        batches: Sequence[int] = (),
        finite: bool | None = None,
        keep: Callable[[], Callable[[], None]] | None = None,
        idle: tuple[tuple[int, int], ...] = (),
        norm_sq: float | None = None,
    ) -> PushResult:
        """Apply (under sync, accumulate) a gradient and its tables' ``rows``, once per
        (worker, iteration) and per server-handed batch (``batches``): a repeated batch
        counts for the clock only. ``grad`` None: an empty push (its batches go back).
        ``finite``: as found while copied (None: check here). ``keep``: ``answer_early``.
        ``idle``, ``norm_sq``: ``codec/idle.py``, ``norm_round.py``."""
        what = f"The gradient of worker {worker_id} for iteration {iteration}"
        skip = self.config.skip_nonfinite
        checked, finite = check_push(
            self.tables, self.manifest, grad, rows, samples, skip, what, finite
        )
        with self._cond:
            self.check_incarnation(incarnation)  # again under the lock: a rewind may have run
            window = max(1, self.policy.max_inflight_pushes())
            member, new = self.members.admit(worker_id, iteration, window)
            if not new:
                self.counters.duplicates += 1
                return PushResult(self.store.version, member.clock, True)
            if self.arrival.late(worker_id, iteration):  # its round closed without it
                member = self.members.dropped(worker_id, iteration)
                self._cond.notify_all()
                return PushResult(self.store.version, member.clock, False)
            batches = self.members.batches_of(worker_id, iteration, batches)
            live = self.membership.live_ids()
            applied, waiting = self.arrival.take(
                worker_id, iteration, grad, checked, finite, batches, live, idle, norm_sq
            )
            self.members.pushed(worker_id, iteration, empty=grad is None)
            self.membership.advance(worker_id, samples if applied else 0)
            if applied:
                self.counters.push(samples, loss, self._now())
            self._settled(self.arrival.settle(self.membership.live_ids()))
            self._cond.notify_all()
            clock = member.clock
            early = self.applies.answer_early(waiting, keep)
        if waiting is not None and not early:
            self.applies.apply(waiting, self._published)
        return PushResult(self.store.version, clock, False)

    def step_norm(
        self, worker_id: str, incarnation: str, round_: int, total: float | None, timeout: float
    ) -> tuple[int, float, bool, tuple[int, float]]:
        """A sync round clipped over shards (``norm_round.py``): without ``total``, once round
        ``round_`` (or an earlier one) closed or within ``timeout``, the round closing and
        its part of the squared norm (-1: none), whether ``round_`` is applied, and the last
        round finished with its total; with ``total``, round ``round_`` applied with it (if
        it is the one closing: its cut). From a worker holding a lease (else UnknownWorker)."""
        with self._cond:
            self.check_incarnation(incarnation)
            self.membership.touch(worker_id)
            if total is None:
                done = lambda: self.arrival.waiting(round_) or self.rounds > round_  # noqa: E731
                self._cond.wait_for(lambda: incarnation != self.incarnation or done(), timeout)
                self.check_incarnation(incarnation)
                closing = self.arrival.waiting(round_)
                found = (closing.round, closing.part) if closing else (-1, 0.0)
                return *found, self.rounds > round_, self.arrival.last
            if self.arrival.finish(round_, total):
                self._settled(True)
                self._settled(self.arrival.settle(self.membership.live_ids()))
                self._cond.notify_all()
            return -1, 0.0, self.rounds > round_, self.arrival.last

    # --- pull -------------------------------------------------------------------------

    def pull_rows(
        self, worker_id: str, incarnation: str, wanted: list[tuple[str, Any]]
    ) -> tuple[list[Any], int]:
        """The rows of each ``(table, ids)`` (this shard's; none if any is bad): the rows
        held, copied under the lock, and the initial values of the rest, computed after
        it; no row is created. An empty id observes (evaluation, checkpoints). With them
        the slowest live clock when they were read (-1: none live): rows are applied as
        their push arrives, so they hold every push below it."""
        tables = self.tables
        if tables is None:
            raise InvalidRequest("A row pull names sparse tables, but this model has none.")
        with self._cond:
            self.check_incarnation(incarnation)
            if worker_id:
                self.membership.touch(worker_id)
            found = tables.lookup_many(wanted, counted=bool(worker_id))
            low = self.membership.min_clock()
        return complete_all(found), -1 if low is None else low

    def pull(
        self,
        worker_id: str,
        iteration: int,
        timeout: float,
        is_active: Callable[[], bool] = lambda: True,
        batches: int = 1,
        incarnation: str = "",
        sink: Callable[[np.ndarray], None] | None = None,
        ahead: bool = False,
    ) -> PullResult:
        """Weights (and up to ``batches`` batches; ``ahead``: the next iteration's too) for
        ``iteration`` once the policy allows (``pulls.Pull``); an empty id observes. The
        last published version's weights (``dense_apply.py``), handed to ``sink`` (a writer
        into a worker's segment) under the lock, or a snapshot shared by one version's pulls.

        Raises:
            Timeout: the policy did not allow the pull within ``timeout`` seconds.
            Whatever ``sink`` raises (``BrokenSegment``): the batches taken stay the
                worker's until it leaves.
        """
        deadline = self._now() + timeout
        with self._cond:
            if not worker_id:
                while (view := self.applies.view()) is None:
                    self._cond.wait()
                return answer(view, self.counters, None, None, sink=sink)
            if self.config.backup_workers:  # a late worker: to the round in progress
                iteration = self.members.caught_up(worker_id, iteration, self.rounds)
            self.members.check_pull(worker_id, iteration, max(self.policy.max_inflight_pushes(), 1))
            pull = Pull(worker_id, iteration, batches, incarnation, sink, ahead)
            result = pull.wait(self, self._cond, self._now, deadline, is_active)
            return dataclasses.replace(result, iteration=iteration)

    # --- waiting and status -----------------------------------------------------------

    def wait_for(self, predicate: Callable[[Coordinator], bool], timeout: float) -> bool:
        """Block until ``predicate(self)`` holds (checked after every state change)."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    def notify(self) -> None:  # wake every waiting pull (a client went away)
        with self._cond:
            self._cond.notify_all()

    def status(self) -> ServerStatus:
        with self._cond:
            return server_status(self, self._now(), self._wall())
