"""The server's state machine: membership, staleness policy and store behind one lock.

No gRPC here: the servicer decodes requests, calls these methods and encodes replies.
Waiting (for a barrier) happens on a condition variable that every state change notifies.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from paramserver.codec.layout import Manifest
from paramserver.codec.rows import RowGradients
from paramserver.config import MAX_PUSH_EVERY, ServerConfig
from paramserver.errors import InvalidRequest, OutOfOrder, Timeout, WrongIncarnation
from paramserver.policy import staleness
from paramserver.policy.staleness import Policy, PushAction
from paramserver.server.buffers import SharedBuffers
from paramserver.server.checks import check_gradient
from paramserver.server.cuts import Cuts
from paramserver.server.dataplan import BatchQueue
from paramserver.server.ledger import Ledger
from paramserver.server.members import Members
from paramserver.server.membership import Membership
from paramserver.server.rounds import SyncRound
from paramserver.server.saves import Saves
from paramserver.server.saving import Saving
from paramserver.server.state import capture
from paramserver.server.status import Counters, ServerStatus, server_status
from paramserver.server.store import ParameterStore
from paramserver.sparse.tableset import RowRound, TableSet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushResult:
    version: int
    clock: int
    duplicate: bool


@dataclass(frozen=True)
class PullResult:
    version: int
    staleness: int
    weights: np.ndarray  # a read-only snapshot; empty when the pull's ``sink`` took them
    batches: tuple[int, ...] = ()  # the global batches to compute; none: nothing for now
    finished: bool = False  # every batch of the run is applied

    @property
    def batch(self) -> int:
        """The first batch to compute; -1: none."""
        return self.batches[0] if self.batches else -1


class Coordinator(Members, Saving):
    """Serialises every decision of the server; thread-safe."""

    def __init__(
        self,
        config: ServerConfig,
        store: ParameterStore,
        now: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.config = config
        self.policy: Policy = config.parsed_policy
        self.store = store
        self.manifest: Manifest = store.manifest
        self.membership = Membership(config.workers, config.lease_seconds, now)
        self.counters = Counters()
        self.incarnation = uuid.uuid4().hex[:12]
        self.started_at = now()
        self._now = now
        self._wall = wall
        self._cond = threading.Condition()
        self._started = False  # becomes True once --min-workers workers are live
        self.rounds = 0  # sync rounds completed
        self.queue: BatchQueue | None = None  # set by the first join that brings data
        self.round = SyncRound()
        self.buffers = SharedBuffers(self.manifest)
        self._params_end = self.manifest.section("param")[1]
        self.saves = Saves()  # the checkpointer's writes: the last one, failures
        # A shard's consistent cuts (``server/cuts.py``): states taken under the lock wait
        # there for the checkpointer (``oldest_cut``); ``Checkpointer`` sets ``cuts.every``.
        self.cuts = Cuts(synchronous=self.policy.synchronous)
        # The whole model's size and where this server's range starts (--shard I/S).
        self.model_numel = self.manifest.numel
        self.shard_offset = 0
        # The frozen parameters, constants a checkpoint holds beside the run's state.
        self.frozen: dict[str, Any] = {}
        # The model's sparse tables (this shard's rows), and the sync round's row gradients.
        self.tables: TableSet | None = None
        self.row_round = RowRound()
        # the server-handed batches this shard applied (each once, whoever pushes it)
        self.ledger = Ledger()

    def check_incarnation(self, incarnation: str) -> None:
        """A call meant for an earlier incarnation of the server (a restart, or a rewind to
        a cut) is refused (ABORTED)."""
        if incarnation and incarnation != self.incarnation:
            raise WrongIncarnation(
                f"This server is incarnation {self.incarnation}, not {incarnation}: it restarted "
                "since the worker joined. Join again."
            )

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
    ) -> PushResult:
        """Apply (or, under sync, accumulate) one gradient and its tables' ``rows``; exactly
        once per (worker, iteration), and once per server-handed batch (``batches``, or on
        the shard that hands them out, the ones it handed for this iteration): a gradient
        of batches this shard applied already counts for the clock and is not applied.

        ``grad`` None is an empty push: the worker's clock moves on (under sync it counts
        for the round), nothing is applied, and the batches it held go back to the queue.
        """
        empty = grad is None
        skip = self.config.skip_nonfinite  # NaN or Inf anywhere, rows too: skipped, counted
        checked = self._tables("A push").check(rows, skip) if rows else []
        finite = check_gradient(grad, samples, self.manifest, skip,
                                f"The gradient of worker {worker_id} for iteration {iteration}", checked)  # fmt: skip
        with self._cond:
            self.check_incarnation(incarnation)  # again under the lock: a rewind may have run
            member = self.membership.get(worker_id)
            window = max(1, self.policy.max_inflight_pushes())
            action = staleness.push_action(iteration, member.clock, window)
            if action is PushAction.DUPLICATE:
                self.membership.touch(worker_id)
                self.counters.duplicates += 1
                return PushResult(self.store.version, member.clock, True)
            if action is PushAction.AHEAD:
                raise OutOfOrder(
                    f"Worker {worker_id} pushed iteration {iteration} but its clock is "
                    f"{member.clock}: iterations were skipped."
                )
            if action is PushAction.PAST:
                raise OutOfOrder(
                    f"Worker {worker_id} pushed iteration {iteration} but its clock is "
                    f"{member.clock}: older than any retry can be."
                )
            self.membership.touch(worker_id)
            if self.queue is not None:  # the shard that hands batches out knows them
                batches = self.queue.taken.get(worker_id, {}).get(iteration, ())
            if not empty and self.ledger.seen(batches, f"Worker {worker_id}'s push"):
                self.ledger.repeated += 1
                log.warning("worker %s pushed batches %s, which this shard applied already: "
                            "counted for its clock, not applied", worker_id, list(batches))  # fmt: skip
                grad, checked, finite = None, [], True
            if not finite:
                self.counters.skipped += 1
                log.warning("skipped the non-finite gradient of worker %s for iteration %d",
                            worker_id, iteration)  # fmt: skip
                grad, checked = None, []
            if grad is not None:
                self.counters.bytes_in += grad.nbytes
                self.buffers.record(worker_id, grad[self._params_end :])
                grad = grad[: self._params_end]
            if self.policy.synchronous:
                self.round.add(worker_id, grad)
                self.row_round.add(checked)
            elif grad is not None:
                if checked:  # at this step's rate (--lr-schedule), as the dense part
                    self._tables("A push").apply(checked, self.store.lr)
                self.store.apply(grad)
                self._share_buffers(self.membership.live_ids())
            if grad is not None or not finite:
                self.ledger.add(batches)
            if self.queue is not None and empty:
                self.queue.give_back(worker_id, iteration)
            elif self.queue is not None:
                self.queue.complete(worker_id, iteration)
            self.membership.advance(worker_id, samples if grad is not None else 0)
            if grad is not None:
                self.counters.push(samples, loss, self._now())
            if self.policy.synchronous:
                self._maybe_finish_round()
            else:
                self._maybe_cut()
            self._cond.notify_all()
            return PushResult(self.store.version, member.clock, False)

    def _maybe_finish_round(self) -> None:
        if not self.policy.synchronous:
            return
        if self.round.complete(self.membership.live_ids()):
            self._share_buffers(self.round.givers)
            n = self.round.n
            mean = self.round.take_mean()
            if self.tables is not None and n:
                self.tables.apply(self.row_round.take_mean(n), self.store.lr)
            if mean is not None:
                self.store.apply(mean)
            self.rounds += 1
            cut = self.cuts.after_round(self.rounds)
            if cut is not None:
                self.cuts.take(cut, capture(self, cut))

    def _share_buffers(self, workers: Iterable[str]) -> None:
        if not self.buffers.size:  # a model (or shard) without buffers: nothing to share
            return
        values = self.buffers.combine(workers)
        if values is not None:
            self.store.set_buffers(values)

    def _maybe_cut(self) -> None:
        cut = self.cuts.reached(self.membership.min_clock())
        if cut is not None:
            self.cuts.take(cut, capture(self, cut))

    def _tables(self, what: str) -> TableSet:
        if self.tables is None:
            raise InvalidRequest(f"{what} names sparse tables, but this model has none.")
        return self.tables

    # --- pull -------------------------------------------------------------------------

    def pull_rows(self, worker_id: str, incarnation: str, wanted: list[tuple[str, Any]]) -> Any:
        """The rows of each ``(table, ids)`` (this shard's), created on first touch (none if
        any is bad); an empty id observes (evaluation, checkpoints), creating no row."""
        tables = self._tables("A row pull")
        with self._cond:
            self.check_incarnation(incarnation)
            if not worker_id:
                return [tables.table(table).read(ids) for table, ids in wanted]
            self.membership.touch(worker_id)
            return tables.pull_many(wanted)

    def pull(
        self,
        worker_id: str,
        iteration: int,
        timeout: float,
        is_active: Callable[[], bool] = lambda: True,
        batches: int = 1,
        incarnation: str = "",
        sink: Callable[[np.ndarray], None] | None = None,
    ) -> PullResult:
        """Weights (and up to ``batches`` batches, ``--push-every``) for ``iteration`` once
        the policy allows; an empty id observes.

        Under ``ssp:K`` and ``async`` a worker that finds no batch left waits for one (a
        batch given back by a dead worker) or for the end of the run, unless it holds an
        earlier batch not pushed yet (a prefetch: the end would wait for it); then, as under
        ``sync``, it gets batch -1 and pushes an empty gradient.

        ``sink`` (a writer into a worker's shared segment) is handed the live weights
        under the lock, so it copies exactly one version's; without it the result holds a
        snapshot shared by the pulls of one version.

        Raises:
            Timeout: the policy did not allow the pull within ``timeout`` seconds.
            Whatever ``sink`` raises (``BrokenSegment``): the batches taken stay the
                worker's until it leaves.
        """
        if not 1 <= batches <= MAX_PUSH_EVERY:
            raise InvalidRequest(
                f"A pull may ask for 1 to {MAX_PUSH_EVERY} batches, not {batches}."
            )
        deadline = self._now() + timeout
        with self._cond:
            if not worker_id:
                return self._answer(None, sink=sink)
            member = self.membership.touch(worker_id)
            window = max(self.policy.max_inflight_pushes(), 1)
            staleness.check_pull_iteration(worker_id, iteration, member.clock, window)
            waited_from = self._now()
            try:
                while True:
                    if self.queue is not None and self.queue.finished:
                        # nothing left to compute: no staleness to speak of
                        return self._answer(None, finished=True, sink=sink)
                    if self._pull_ready(iteration):
                        if self.queue is None:
                            return self._answer(iteration, sink=sink)
                        taken = self.queue.take(worker_id, iteration, batches)
                        wait = not self.policy.synchronous  # for a batch, or the end
                        if taken or not wait or self.queue.holds_before(worker_id, iteration):
                            return self._answer(iteration, tuple(taken), sink=sink)
                    remaining = deadline - self._now()
                    if remaining <= 0 or not is_active():
                        raise Timeout(self._wait_message(worker_id, iteration, timeout))
                    self._cond.wait(min(remaining, self.config.lease_seconds))
                    self.check_incarnation(incarnation)  # rewound while waiting: ABORTED
                    self.membership.get(worker_id)  # evicted while waiting: UnknownWorker
            finally:
                self.counters.barrier_wait_seconds += self._now() - waited_from

    def _pull_ready(self, iteration: int) -> bool:
        if not self._started:
            return False
        if self.cuts.full:
            return False  # the cuts taken wait for the disk: no more until one is written
        low = self.membership.min_clock()
        if self.cuts.holds(iteration, low):
            return False  # every worker reaches the cut before anyone computes past it
        return self.policy.pull_ready(iteration, low, self.rounds)

    def _answer(
        self,
        iteration: int | None,
        batches: tuple[int, ...] = (),
        finished: bool = False,
        sink: Callable[[np.ndarray], None] | None = None,
    ) -> PullResult:
        if sink is None:
            weights = self.store.snapshot()
            self.counters.bytes_out += weights.nbytes
        else:
            live = self.store.weights
            sink(live)
            self.counters.bytes_out += live.nbytes
            weights = live[:0]
        lag = 0
        if iteration is not None:
            lag = staleness.staleness(iteration, self.membership.min_clock())
            self.counters.pull(lag)
        return PullResult(self.store.version, lag, weights, batches, finished)

    def _wait_message(self, worker_id: str, iteration: int, timeout: float) -> str:
        if not self._started:
            return (
                f"Worker {worker_id} waited {timeout:.0f}s for the run to start: "
                f"{len(self.membership.members)} of {self.config.start_workers} workers are live."
            )
        disk = ""
        if self.cuts.full:
            disk = (f" {len(self.cuts.pending)} consistent cuts wait to be written to disk"
                    f" ({self.saves.error or 'a slow disk'}).")  # fmt: skip
        return (
            f"Worker {worker_id} waited {timeout:.0f}s to pull iteration {iteration} under "
            f"{self.policy.name}; the slowest live clock is {self.membership.min_clock()}."
            f"{disk}"
        )

    def wait_for(self, predicate: Callable[[Coordinator], bool], timeout: float) -> bool:
        """Block until ``predicate(self)`` holds (checked after every state change)."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    def notify(self) -> None:
        """Wake every waiting pull (a client went away)."""
        with self._cond:
            self._cond.notify_all()

    # --- status -----------------------------------------------------------------------

    def status(self) -> ServerStatus:
        with self._cond:
            return server_status(self, self._now(), self._wall())
