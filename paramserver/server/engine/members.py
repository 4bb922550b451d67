"""Who is in the run and which batches they hold: the membership (leases, clocks, ranks),
the batch queue (planned by the first join that brings data) and whether the run has started
(``--min-workers`` workers live).

A collaborator of the coordinator: ``Members`` owns this state and decides joins, departures,
whether a push is new work by the worker's clock (exactly once: a retry within the window is
a duplicate) and which batches a step computes. The coordinator calls it under its lock, and
decides what a departure means for the model (``Coordinator._after_leaving``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from paramserver.config import ServerConfig
from paramserver.errors import OutOfOrder
from paramserver.policy import staleness
from paramserver.policy.staleness import PushAction
from paramserver.server.bookkeeping.batch_queue import BatchQueue
from paramserver.server.bookkeeping.leases import Member, Membership
from paramserver.server.bookkeeping.snapshot import CoordinatorSnapshot

log = logging.getLogger("paramserver.server.engine.coordinator")


# Leases a worker restored from a checkpoint (or a cut) has to come back.
RETURN_LEASES = 3


class Members:
    """The live workers, their batches, and whether training has started."""

    def __init__(
        self,
        config: ServerConfig,
        now: Callable[[], float] = time.monotonic,
        membership: Membership | None = None,
        queue: BatchQueue | None = None,
        started: bool = False,
    ):
        self.config = config
        self.membership = membership or Membership(config.workers, config.lease_seconds, now)
        self.queue = queue  # None until a join brings data
        self.started = started  # True once --min-workers workers are live
        self.told_over = False  # a worker left saying the run is finished
        self.owner = config.shard == 0  # it hands out the batches, and decides the end
        # the workers a checkpoint brought back, until each joins again (logged then)
        self.returning: set[str] = set(self.membership.members)

    @classmethod
    def restored(
        cls, config: ServerConfig, now: Callable[[], float], snapshot: CoordinatorSnapshot
    ) -> Members:
        """The snapshot's workers, back as live members with a lease of ``RETURN_LEASES``
        leases (a restarted shard of several comes back one after another, and its workers
        notice at their next call): a worker that rejoins with its id goes on from its
        clock; one that does not come back by then is dropped, and the batches it held go to
        the others. (With one lease, a shard whose restart took longer than it dropped the
        workers it knew, and its sync round went on without them while the other shard's
        waited: ``paramserver chaos`` found it.)"""
        membership = Membership.from_state(
            {"members": snapshot.members, **snapshot.membership},
            config.workers,
            config.lease_seconds,
            now,
        )
        for m in membership.members.values():  # the lease runs out RETURN_LEASES later
            m.last_seen = now() + (RETURN_LEASES - 1) * config.lease_seconds
        if snapshot.policy != config.parsed_policy.name:
            log.warning(
                "the checkpoint was written under %s; going on under %s",
                snapshot.policy,
                config.parsed_policy.name,
            )
        log.info(
            "resumed from incarnation %s at version %d with %d workers",
            snapshot.incarnation,
            snapshot.version,
            len(membership.members),
        )
        queue = BatchQueue.from_state(snapshot.queue) if snapshot.queue is not None else None
        started = bool(membership.members) or snapshot.version > 0
        if queue is not None:
            _replan(queue, config.epochs)
        if queue is not None and queue.finished:
            log.warning(
                "the run in %s is over: all %d of its batches were applied (version %d). "
                "Workers that join get nothing to train; to train on, start the server with "
                "more --epochs, or with another --checkpoint-dir to train anew",
                config.checkpoint_dir,
                queue.total,
                snapshot.version,
            )
        return cls(config, now, membership, queue, started)

    def state(self) -> dict[str, Any]:
        """The snapshot's ``members``, ``membership`` and ``queue``."""
        membership = self.membership.state()
        return {
            "members": membership.pop("members"),
            "membership": membership,
            "queue": self.queue.state() if self.queue is not None else None,
        }

    def join(
        self,
        name: str,
        worker_id: str,
        train_samples: int,
        join_id: str,
        start: int | None,
        past_ids: Sequence[str] = (),
    ) -> Member:
        """Admit a worker (at clock ``start`` when none is live), or take back one that
        knows its id, or one of its ``past_ids`` (the state it rejoins was saved while it
        held that id: a shard rewound to a cut); a retry of a join attempt (``join_id``)
        gets the same member.

        Raises:
            ClusterFull: ``--workers`` workers are live.
            InvalidRequest: its data set does not match the one the run's batches come from.
        """
        cfg = self.config
        if self.owner:  # another shard plans nothing, whatever a Join says of its data
            self.queue = BatchQueue.plan(self.queue, train_samples, cfg.batch_size, cfg.epochs)
        member = self.membership.members.get(worker_id) if worker_id else None
        for past in past_ids if member is None else ():
            member = self.membership.members.get(past)
            if member is not None:
                log.info("worker %s (%s) is member %s of this state again", worker_id, name, past)
                worker_id = past
                break
        if member is not None:  # its start-up's second Join (its payload path), or a rejoin
            self.membership.touch(worker_id)
            if worker_id in self.returning:
                self.returning.discard(worker_id)
                log.info(
                    "worker %s (rank %d) came back after the restart, at clock %d",
                    worker_id,
                    member.rank,
                    member.clock,
                )
            else:
                log.debug("worker %s (rank %d) joined again while live", worker_id, member.rank)
            return member
        joined = self.membership.joined_total
        member = self.membership.join(name, start_clock=start, join_id=join_id)
        self.told_over = False  # a new member: the run goes on (extended, say), until told
        what = "joined" if self.membership.joined_total > joined else "joined (a retry)"
        if not self.started and len(self.membership.members) >= cfg.start_workers:
            self.started = True
        log.info(
            "worker %s (%s) %s as rank %d at clock %d; %d live",
            member.worker_id,
            name,
            what,
            member.rank,
            member.clock,
            len(self.membership.members),
        )
        return member

    def leave(self, worker_id: str, finished: bool = False, current: bool = True) -> list[Member]:
        """The worker leaves at its own request: it, or none if it was not live.
        ``finished``: it says the run is over (``told``); ``current``: its Leave names
        this incarnation."""
        member = self.membership.leave(worker_id)
        if finished:
            self._told(worker_id, member is not None, current)
        if member is None:
            return []
        log.info("worker %s (rank %d) left at clock %d", worker_id, member.rank, member.clock)
        return [member]

    def _told(self, worker_id: str, live: bool, current: bool) -> None:
        """A Leave says the run is over. Shard 0 hands out the batches, knows whether it is
        and takes nobody's word for it (without a batch plan, a run of the workers' own
        data, it never ends by itself); another shard believes a live member of this
        incarnation (``server --exit-when-done``), and no one else: a Leave from an id that
        holds no lease, or one meant for the server before a restart (with more
        ``--epochs``, the run goes on), ends nothing."""
        q, why = self.queue, ""
        if self.owner and (q is None or not q.finished):
            left = f"{q.total - q.done} of the run's {q.total}" if q is not None else "all"
            why = f"but {left} batches are not applied here, which hands them out"
        elif not live:
            why = "which holds no lease here"
        elif not current:
            why = "whose Leave names another incarnation of this server (from before a restart)"
        if why:
            log.warning("worker %s left saying the run is finished, %s: ignored", worker_id, why)
        elif not self.owner:
            self.told_over = True

    def expire(self, paused: float = 0.0, at: float | None = None) -> list[Member]:
        """Drop the workers whose lease had run out at ``at``, when the caller looked (default:
        now); returns them. ``paused``: seconds this server itself did not run (a SIGSTOP, a
        long pause of the host) since the last look; then every lease starts again instead,
        for no worker could renew its lease while the server could not answer."""
        if paused > 0:
            log.warning(
                "this server did not run for %.1fs (paused, or starved); every worker's "
                "lease starts again",
                paused,
            )
            self.membership.renew_all()
        dead = self.membership.expire(at)
        for m in dead:
            log.warning(
                "worker %s (%s, rank %d) missed its %.1fs lease at clock %d; it no "
                "longer holds back the others",
                m.worker_id,
                m.name,
                m.rank,
                self.config.lease_seconds,
                m.clock,
            )
        return dead

    def progress(self) -> tuple[int, int] | None:
        """(batches done, the run's batches); None without a batch plan."""
        q = self.queue
        return (q.done, q.total) if q is not None else None

    def forgotten(self) -> list[Member]:
        """With ``--forget-workers``, the workers a checkpoint brought back, dropped now:
        their launcher knows they are gone (they held a resumed launch's new workers off
        as a full run for three leases). Else none."""
        if not self.config.forget_workers or not self.returning:
            return []
        gone = [self.membership.members[w] for w in sorted(self.returning)]
        for m in gone:
            self.membership.leave(m.worker_id)
        self.returning.clear()
        log.info(
            "dropped the %d workers the checkpoint names (--forget-workers): their batches "
            "go to the workers that join",
            len(gone),
        )
        return gone

    def release(self, gone: list[Member]) -> None:
        """The batches the ``gone`` workers took and did not push go back to the queue."""
        if self.queue is None:
            return
        for m in gone:
            back = self.queue.release(m.worker_id)
            if back:
                log.info("batches %s of worker %s go back to the queue", back, m.worker_id)

    # --- a step's clock and batches ---------------------------------------------------

    def admit(self, worker_id: str, iteration: int, window: int) -> tuple[Member, bool]:
        """The member pushing ``iteration``, and whether it is new work (False: a retry of a
        push applied, within its ``window`` of pushes in flight); either renews its lease.

        Raises:
            UnknownWorker: ``worker_id`` holds no lease.
            OutOfOrder: iterations were skipped, or it is older than any retry can be.
        """
        member = self.membership.get(worker_id)
        action = staleness.push_action(iteration, member.clock, window)
        if action is PushAction.AHEAD:
            raise OutOfOrder(
                f"Worker {worker_id} pushed iteration {iteration} but its clock "
                f"is {member.clock}: iterations were skipped."
            )
        if action is PushAction.PAST:
            raise OutOfOrder(
                f"Worker {worker_id} pushed iteration {iteration} but its clock "
                f"is {member.clock}: older than any retry can be."
            )
        self.membership.touch(worker_id)
        return member, action is PushAction.APPLY

    def check_pull(self, worker_id: str, iteration: int, window: int) -> None:
        """Renew the lease of a worker pulling ``iteration``, within ``window`` of its clock.

        Raises:
            UnknownWorker: ``worker_id`` holds no lease.
            OutOfOrder: the iteration is too far from its clock.
        """
        member = self.membership.touch(worker_id)
        staleness.check_pull_iteration(worker_id, iteration, member.clock, window)

    @property
    def finished(self) -> bool:
        """Every batch of the run is applied (never, without a data plan)."""
        return self.queue is not None and self.queue.finished

    @property
    def done(self) -> bool:
        """The run is over and every worker has gone (``server --exit-when-done``): every
        batch applied here (shard 0, which hands them out, decides), or elsewhere a live
        worker of this incarnation left saying so (``_told``)."""
        over = self.finished if self.owner else self.told_over
        return over and self.started and not self.membership.members

    def batches_of(self, worker_id: str, iteration: int, named: Sequence[int]) -> Sequence[int]:
        """The batches a push of ``iteration`` computed: on the shard that hands them out,
        those it handed out; elsewhere the ones the push names."""
        if self.queue is None:
            return named
        return self.queue.taken.get(worker_id, {}).get(iteration, ())

    def pushed(self, worker_id: str, iteration: int, empty: bool) -> None:
        """A push of ``iteration`` was accepted: its batches are done, or (an empty push,
        which computed nothing) go back to the queue."""
        if self.queue is None:
            return
        if empty:
            self.queue.give_back(worker_id, iteration)
        else:
            self.queue.complete(worker_id, iteration)

    def dropped(self, worker_id: str, iteration: int) -> Member:
        """A late push (``--backup-workers``): its batches go back to the queue and its
        clock moves on; nothing of it reaches the model."""
        self.pushed(worker_id, iteration, empty=True)
        return self.membership.advance(worker_id, 0)

    def caught_up(self, worker_id: str, iteration: int, rounds: int) -> int:
        """The iteration a pull is answered for under sync with backup workers: a worker
        whose pushes have all arrived (its clock is the pull's) and whose round already
        closed without it (``rounds`` closed so far) jumps to the round in progress, so it
        computes for a round still open; the batches it took for the rounds it skips go
        back. A retry of that pull gets the same answer."""
        member = self.membership.get(worker_id)
        if member.caught_up_from == iteration < member.clock:
            return member.clock
        if member.clock == iteration < rounds:
            if self.queue is not None:
                self.queue.release_from(worker_id, iteration)
            member.caught_up_from, member.clock = iteration, rounds
            return rounds
        return iteration

    def hand_out(
        self, worker_id: str, iteration: int, count: int, wait: bool
    ) -> tuple[int, ...] | None:
        """Up to ``count`` batches for ``worker_id`` to compute at ``iteration``; empty: none
        (no data plan, or none left and no ``wait``). None: wait for a batch given back or
        for the end (``wait``), unless the worker holds an earlier batch not pushed yet (a
        prefetch: the end would wait for it)."""
        if self.queue is None:
            return ()
        taken = self.queue.take(worker_id, iteration, count)
        if taken or not wait or self.queue.holds_before(worker_id, iteration):
            return tuple(taken)
        return None

    def waiting(
        self, worker_id: str, iteration: int, timeout: float, policy: str, disk: str = ""
    ) -> str:
        """Why a pull of ``iteration`` waited ``timeout`` seconds (``disk``: what the cuts
        waiting for the disk add, once the run has started)."""
        if not self.started:
            return (
                f"Worker {worker_id} waited {timeout:.0f}s for the run to start: "
                f"{len(self.membership.members)} of {self.config.start_workers} workers are live."
            )
        return (
            f"Worker {worker_id} waited {timeout:.0f}s to pull iteration {iteration} under "
            f"{policy}; the slowest live clock is {self.membership.min_clock()}.{disk}"
        )


def _replan(queue: BatchQueue, epochs: int) -> None:
    """A resumed run and the ``--epochs`` it was started with: more extend the plan (the
    batches applied stay applied, the new epochs follow); fewer are ignored, said why."""
    if epochs > queue.epochs:
        log.info(
            "--epochs %d: the run goes on from %d to %d epochs (batches %d to %d follow the "
            "%d applied; a cosine schedule keeps its --lr-total-steps)",
            epochs,
            queue.epochs,
            epochs,
            queue.total,
            queue.per_epoch * epochs - 1,
            queue.done,
        )
        queue.epochs = epochs
    elif epochs < queue.epochs:
        log.warning(
            "--epochs %d is ignored: the run resumed holds %d epochs, of which %d batches are "
            "applied, and a plan is only ever extended (give --epochs %d or more)",
            epochs,
            queue.epochs,
            queue.done,
            queue.epochs,
        )
