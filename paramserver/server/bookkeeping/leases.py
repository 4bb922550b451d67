"""Leases, clocks, ranks: who is in the run. Pure bookkeeping with an injectable clock."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paramserver.errors import ClusterFull, UnknownWorker


@dataclass
class Member:
    """One live worker."""

    worker_id: str
    name: str
    rank: int
    clock: int
    last_seen: float
    samples: int = 0
    joined_at: float = 0.0  # when this server admitted it (its clock)
    samples_at_join: int = 0  # samples it had then (non-zero after a resume)
    row_cache: tuple[int, int] = (0, 0)  # its tables' cache hits and misses, as last pushed
    join_id: str = ""  # the join attempt that admitted it (JoinRequest.join_id)
    caught_up_from: int = -1  # the iteration a pull of it was moved on from (backups)


@dataclass
class Membership:
    """The live workers and their leases.

    A worker holds a lease while it calls the server at least every ``lease_seconds``.
    Ranks are slots 0..capacity-1: a new worker takes the lowest free one, so a worker
    that replaces a dead one takes over its data shard.
    """

    capacity: int
    lease_seconds: float
    now: Callable[[], float] = time.monotonic
    members: dict[str, Member] = field(default_factory=dict)
    joined_total: int = 0
    expired_total: int = 0
    _floor: int = 0  # the slowest live clock last seen: where a newcomer starts

    def join(self, name: str, start_clock: int | None = None, join_id: str = "") -> Member:
        """Admit a worker; its clock starts at the slowest live clock (or ``start_clock``).

        A join attempt (``join_id``) admits at most one member: a retry of an attempt whose
        reply was lost gets the member it admitted, with its lease renewed.

        Raises:
            ClusterFull: ``capacity`` workers are already live.
        """
        if join_id:
            for member in self.members.values():
                if member.join_id == join_id:
                    member.last_seen = self.now()
                    return member
        if len(self.members) >= self.capacity:
            raise ClusterFull(
                f"The server was started for {self.capacity} workers and "
                f"{len(self.members)} are live; start it with a larger --workers to admit "
                f"{name!r}."
            )
        taken = {m.rank for m in self.members.values()}
        rank = next(r for r in range(self.capacity) if r not in taken)
        clock = self.min_clock()
        if clock is None:
            clock = self._floor if start_clock is None else start_clock
        now = self.now()
        member = Member(
            uuid.uuid4().hex[:16], name, rank, clock, now, joined_at=now, join_id=join_id
        )
        self.members[member.worker_id] = member
        self.joined_total += 1
        return member

    def get(self, worker_id: str) -> Member:
        """The live member with this id.

        Raises:
            UnknownWorker: no live worker has this id (never joined, left or expired).
        """
        member = self.members.get(worker_id)
        if member is None:
            raise UnknownWorker(
                f"Worker {worker_id!r} is not a live member of this server: it never joined, "
                "left, or its lease expired."
            )
        return member

    def rate(self, member: Member) -> float:
        """Samples per second the worker has pushed since this server admitted it."""
        return (member.samples - member.samples_at_join) / max(self.now() - member.joined_at, 1e-9)

    def touch(self, worker_id: str) -> Member:
        """Renew the lease of a live worker."""
        member = self.get(worker_id)
        member.last_seen = self.now()
        return member

    def advance(self, worker_id: str, samples: int) -> Member:
        """Count one accepted push: the worker's clock moves on by one."""
        member = self.touch(worker_id)
        member.clock += 1
        member.samples += samples
        return member

    def leave(self, worker_id: str) -> Member | None:
        """Remove a worker at its own request; None if it was not live."""
        self.min_clock()
        return self.members.pop(worker_id, None)

    def renew_all(self) -> None:
        """Every lease starts again now: the server itself was not running (paused, or
        starved), so no worker could renew its lease meanwhile."""
        now = self.now()
        for m in self.members.values():
            m.last_seen = max(m.last_seen, now)

    def expire(self, at: float | None = None) -> list[Member]:
        """Remove every worker whose lease had run out at ``at`` (default: now); returns
        them."""
        self.min_clock()
        deadline = (self.now() if at is None else at) - self.lease_seconds
        dead = [m for m in self.members.values() if m.last_seen < deadline]
        for m in dead:
            del self.members[m.worker_id]
        self.expired_total += len(dead)
        return dead

    def min_clock(self) -> int | None:
        """The smallest clock among live workers, or None when none is live."""
        if not self.members:
            return None
        low = min(m.clock for m in self.members.values())
        self._floor = max(self._floor, low)
        return low

    @property
    def floor(self) -> int:
        return self._floor

    def state(self) -> dict[str, Any]:
        """For a checkpoint: the members' clocks say which pushes the weights hold."""
        return {
            "members": [
                {
                    "worker_id": m.worker_id,
                    "name": m.name,
                    "rank": m.rank,
                    "clock": m.clock,
                    "samples": m.samples,
                    "join_id": m.join_id,
                }
                for m in self.members.values()
            ],
            "floor": self._floor,
            "joined_total": self.joined_total,
            "expired_total": self.expired_total,
        }

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any],
        capacity: int,
        lease_seconds: float,
        now: Callable[[], float] = time.monotonic,
    ) -> Membership:
        """The members of a checkpoint, each with a fresh lease."""
        t = now()
        members = {
            m["worker_id"]: Member(
                m["worker_id"],
                m["name"],
                int(m["rank"]),
                int(m["clock"]),
                t,
                int(m["samples"]),
                joined_at=t,
                samples_at_join=int(m["samples"]),
                join_id=str(m.get("join_id", "")),
            )
            for m in state["members"]
        }
        return cls(
            capacity,
            lease_seconds,
            now,
            members,
            joined_total=int(state["joined_total"]),
            expired_total=int(state["expired_total"]),
            _floor=int(state["floor"]),
        )

    def live_ids(self) -> list[str]:
        """Ids of the live workers."""
        return list(self.members)
