"""The coordinator's membership calls: join, heartbeat, leave, leases. A part of
``Coordinator`` (which it is mixed into), split out for size: its state and lock are the
coordinator's, declared here for the type checker."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from paramserver.server.dataplan import BatchQueue
from paramserver.server.membership import Member, Membership

if TYPE_CHECKING:
    from paramserver.config import ServerConfig
    from paramserver.policy.staleness import Policy
    from paramserver.server.buffers import SharedBuffers
    from paramserver.server.store import ParameterStore

log = logging.getLogger("paramserver.server.coordinator")


class Members:
    """Who is in the run, under the coordinator's lock."""

    if TYPE_CHECKING:
        _cond: threading.Condition
        _started: bool
        config: ServerConfig
        policy: Policy
        store: ParameterStore
        membership: Membership
        queue: BatchQueue | None
        buffers: SharedBuffers
        rounds: int

        def _share_buffers(self, workers: Any) -> None: ...
        def _maybe_finish_round(self) -> None: ...
        def _maybe_cut(self) -> None: ...

    def join(
        self, name: str, worker_id: str = "", train_samples: int = 0, join_id: str = ""
    ) -> Member:
        """Admit a worker, or take back one that knows its id (a retry, or after a restart);
        a retry of a join attempt (``join_id``) whose reply was lost gets the same member.

        Raises:
            ClusterFull: ``--workers`` workers are live.
            InvalidRequest: its data set does not match the one the run's batches come from.
        """
        with self._cond:
            self.queue = BatchQueue.plan(self.queue, train_samples, self.config.batch_size,
                                         self.config.epochs)  # fmt: skip
            member = self.membership.members.get(worker_id) if worker_id else None
            if member is not None:
                self.membership.touch(worker_id)
                what = "rejoined"
            else:
                start = self.rounds if self.policy.synchronous else None
                joined = self.membership.joined_total
                member = self.membership.join(name, start_clock=start, join_id=join_id)
                what = "joined" if self.membership.joined_total > joined else "joined (a retry)"
            if not self._started and len(self.membership.members) >= self.config.start_workers:
                self._started = True
            log.info("worker %s (%s) %s as rank %d at clock %d; %d live", member.worker_id, name,
                     what, member.rank, member.clock, len(self.membership.members))  # fmt: skip
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
                log.info("worker %s (rank %d) left at clock %d", worker_id, member.rank,
                         member.clock)  # fmt: skip
                self._after_membership_change([member])

    def expire_leases(self) -> list[Member]:
        """Drop workers whose lease ran out, so that no barrier waits on them."""
        with self._cond:
            dead = self.membership.expire()
            for m in dead:
                log.warning("worker %s (%s, rank %d) missed its %.1fs lease at clock %d; it no "
                            "longer holds back the others", m.worker_id, m.name, m.rank,
                            self.config.lease_seconds, m.clock)  # fmt: skip
            if dead:
                self._after_membership_change(dead)
            return dead

    def _after_membership_change(self, gone: list[Member]) -> None:
        # A departed worker's gradient already in the round sum stays: it is valid work.
        # The batches it took and did not push go back to the queue for someone else.
        if self.queue is not None:
            for m in gone:
                back = self.queue.release(m.worker_id)
                if back:
                    log.info("batches %s of worker %s go back to the queue", back, m.worker_id)
        self.buffers.keep_only(self.membership.live_ids())
        if not self.policy.synchronous:
            self._share_buffers(self.membership.live_ids())
        self._maybe_finish_round()
        self._maybe_cut()
        self._cond.notify_all()
