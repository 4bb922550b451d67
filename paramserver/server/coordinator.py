"""The server's state machine: membership, staleness policy and store behind one lock.

No gRPC here: the servicer decodes requests, calls these methods and encodes replies.
Waiting (for a barrier) happens on a condition variable that every state change notifies.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from paramserver import staleness
from paramserver.codec import Manifest
from paramserver.config import ServerConfig
from paramserver.errors import InvalidRequest, OutOfOrder, Timeout
from paramserver.membership import Member, Membership
from paramserver.staleness import Policy, PushAction
from paramserver.store import ParameterStore

log = logging.getLogger(__name__)


@dataclass
class Counters:
    """What the server has done, for Status."""

    pushes_applied: int = 0
    duplicates: int = 0
    samples: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    max_staleness: int = 0
    histogram: Counter[int] = field(default_factory=Counter)
    train_loss: float = math.nan
    first_push: float | None = None
    last_push: float | None = None


@dataclass(frozen=True)
class PushResult:
    version: int
    clock: int
    duplicate: bool


@dataclass(frozen=True)
class PullResult:
    version: int
    staleness: int
    weights: np.ndarray  # read-only snapshot


class Coordinator:
    """Serialises every decision of the server; thread-safe."""

    def __init__(
        self,
        config: ServerConfig,
        store: ParameterStore,
        now: Callable[[], float] = time.monotonic,
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
        self._cond = threading.Condition()
        self._started = False  # becomes True once --workers workers have joined
        self._round_sum: np.ndarray | None = None
        self._round_from: set[str] = set()

    # --- membership -----------------------------------------------------------------

    def join(self, name: str) -> Member:
        with self._cond:
            start = self.store.version if self.policy.synchronous else None
            member = self.membership.join(name, start_clock=start)
            if not self._started and self.membership.joined_total >= self.config.workers:
                self._started = True
            log.info(
                "worker %s (%s) joined as rank %d at clock %d; %d live",
                member.worker_id,
                name,
                member.rank,
                member.clock,
                len(self.membership.members),
            )
            self._cond.notify_all()
            return member

    def heartbeat(self, worker_id: str) -> int:
        with self._cond:
            self.membership.touch(worker_id)
            return self.store.version

    def leave(self, worker_id: str) -> None:
        with self._cond:
            member = self.membership.leave(worker_id)
            if member is not None:
                log.info(
                    "worker %s (rank %d) left at clock %d", worker_id, member.rank, member.clock
                )
                self._after_membership_change()

    def expire_leases(self) -> list[Member]:
        """Drop workers whose lease ran out, so that no barrier waits on them."""
        with self._cond:
            dead = self.membership.expire()
            for m in dead:
                log.warning(
                    "worker %s (%s, rank %d) missed its %.1fs lease at clock %d; it no longer "
                    "holds back the others",
                    m.worker_id,
                    m.name,
                    m.rank,
                    self.config.lease_seconds,
                    m.clock,
                )
            if dead:
                self._after_membership_change()
            return dead

    def _after_membership_change(self) -> None:
        # A departed worker's gradient already in the round sum stays: it is valid work.
        self._maybe_finish_round()
        self._cond.notify_all()

    # --- push -------------------------------------------------------------------------

    def check_push(self, worker_id: str, iteration: int, total_bytes: int) -> None:
        """Validate a push header before its payload is read."""
        with self._cond:
            self.membership.touch(worker_id)
        if total_bytes != self.manifest.total_bytes:
            raise InvalidRequest(
                f"A push of {total_bytes} bytes does not match the model's "
                f"{self.manifest.total_bytes} bytes."
            )
        if iteration < 0:
            raise InvalidRequest(f"Iteration {iteration} is negative.")

    def push(
        self, worker_id: str, iteration: int, grad: np.ndarray, samples: int, loss: float
    ) -> PushResult:
        """Apply (or, under sync, accumulate) one gradient; exactly once per (worker, iteration)."""
        if grad.dtype != np.float32 or grad.size != self.manifest.numel:
            raise InvalidRequest(
                f"A gradient of {grad.size} {grad.dtype} values does not match the model's "
                f"{self.manifest.numel} float32 values."
            )
        if not np.isfinite(grad).all():
            raise InvalidRequest(
                f"The gradient of worker {worker_id} for iteration {iteration} holds NaN or Inf; "
                "it was not applied."
            )
        with self._cond:
            member = self.membership.touch(worker_id)
            self.counters.bytes_in += grad.nbytes
            action = staleness.push_action(iteration, member.clock)
            if action is PushAction.DUPLICATE:
                self.counters.duplicates += 1
                return PushResult(self.store.version, member.clock, True)
            if action is PushAction.AHEAD:
                raise OutOfOrder(
                    f"Worker {worker_id} pushed iteration {iteration} but its clock is "
                    f"{member.clock}: iterations were skipped."
                )
            if self.policy.synchronous:
                if self._round_sum is None:
                    self._round_sum = grad.copy()
                else:
                    self._round_sum += grad
                self._round_from.add(worker_id)
            else:
                self.store.apply(grad)
            self.membership.advance(worker_id, samples)
            self._count_push(samples, loss)
            if self.policy.synchronous:
                self._maybe_finish_round()
            self._cond.notify_all()
            return PushResult(self.store.version, member.clock, False)

    def _count_push(self, samples: int, loss: float) -> None:
        c = self.counters
        c.pushes_applied += 1
        c.samples += samples
        now = self._now()
        c.first_push = now if c.first_push is None else c.first_push
        c.last_push = now
        if math.isfinite(loss):
            c.train_loss = loss if math.isnan(c.train_loss) else 0.98 * c.train_loss + 0.02 * loss

    def _maybe_finish_round(self) -> None:
        if not self.policy.synchronous or self._round_sum is None:
            return
        if staleness.round_complete(self._round_from, self.membership.live_ids()):
            self._round_sum /= len(self._round_from)
            self.store.apply(self._round_sum)
            self._round_sum = None
            self._round_from = set()

    # --- pull -------------------------------------------------------------------------

    def pull(
        self,
        worker_id: str,
        iteration: int,
        timeout: float,
        is_active: Callable[[], bool] = lambda: True,
    ) -> PullResult:
        """Weights for ``iteration`` once the policy allows; an empty id observes at once.

        Raises:
            Timeout: the policy did not allow the pull within ``timeout`` seconds.
        """
        deadline = self._now() + timeout
        with self._cond:
            if not worker_id:
                return self._answer(None)
            member = self.membership.touch(worker_id)
            if iteration > member.clock + max(self.policy.max_inflight_pushes(), 1):
                raise OutOfOrder(
                    f"Worker {worker_id} asked for iteration {iteration} but its clock is "
                    f"{member.clock}."
                )
            while not self._pull_ready(iteration):
                remaining = deadline - self._now()
                if remaining <= 0 or not is_active():
                    raise Timeout(self._wait_message(worker_id, iteration, timeout))
                self._cond.wait(min(remaining, self.config.lease_seconds))
                self.membership.get(worker_id)  # evicted while waiting: UnknownWorker
            return self._answer(iteration)

    def _pull_ready(self, iteration: int) -> bool:
        if not self._started:
            return False
        return self.policy.pull_ready(iteration, self.membership.min_clock(), self.store.version)

    def _answer(self, iteration: int | None) -> PullResult:
        weights = self.store.snapshot()
        self.counters.bytes_out += weights.nbytes
        lag = 0
        if iteration is not None:
            lag = staleness.staleness(iteration, self.membership.min_clock())
            self.counters.histogram[lag] += 1
            self.counters.max_staleness = max(self.counters.max_staleness, lag)
        return PullResult(self.store.version, lag, weights)

    def _wait_message(self, worker_id: str, iteration: int, timeout: float) -> str:
        if not self._started:
            return (
                f"Worker {worker_id} waited {timeout:.0f}s for the run to start: "
                f"{self.membership.joined_total} of {self.config.workers} workers have joined."
            )
        return (
            f"Worker {worker_id} waited {timeout:.0f}s to pull iteration {iteration} under "
            f"{self.policy.name}; the slowest live clock is {self.membership.min_clock()}."
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

    def status(self) -> dict:
        with self._cond:
            now = self._now()
            c = self.counters
            return {
                "version": self.store.version,
                "policy": self.policy.name,
                "workers": [
                    {
                        "worker_id": m.worker_id,
                        "name": m.name,
                        "rank": m.rank,
                        "clock": m.clock,
                        "last_seen_seconds": now - m.last_seen,
                        "samples": m.samples,
                    }
                    for m in sorted(self.membership.members.values(), key=lambda m: m.rank)
                ],
                "pushes_applied": c.pushes_applied,
                "bytes_in": c.bytes_in,
                "bytes_out": c.bytes_out,
                "max_staleness": c.max_staleness,
                "staleness_histogram": dict(c.histogram),
                "samples": c.samples,
                "train_loss": c.train_loss,
                "train_seconds": (c.last_push - c.first_push)
                if c.first_push is not None and c.last_push is not None
                else 0.0,
                "incarnation": self.incarnation,
                "model": self.config.model,
                "world_size": self.config.workers,
                "workers_joined": self.membership.joined_total,
                "workers_expired": self.membership.expired_total,
                "uptime_seconds": now - self.started_at,
                "learning_rate": self.store.lr,
            }
