"""The coordinator's state in and out: the cuts that fall after a push, a round or a
departure; a consistent copy of everything a resumed server needs (a checkpoint's, a cut's);
and such a copy taken over, when a server starts from it or rewinds to it.

A part of ``Coordinator`` (its base class): it reads and assigns the coordinator's fields
under the coordinator's lock, which every method here takes or whose caller holds.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from paramserver.config import ServerConfig
from paramserver.errors import WrongIncarnation
from paramserver.policy.staleness import Policy
from paramserver.server.bookkeeping.buffers import SharedBuffers
from paramserver.server.bookkeeping.leases import Membership
from paramserver.server.bookkeeping.snapshot import CoordinatorSnapshot
from paramserver.server.bookkeeping.status import Counters
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.engine.arrival import Arrival, arrival
from paramserver.server.engine.dense_apply import Applies
from paramserver.server.engine.members import Members
from paramserver.server.engine.saving import Saving
from paramserver.sparse.tableset import TableSet


class StateInOut:
    """The coordinator's cuts, checkpoint state and take-over (``Coordinator`` assigns the
    fields named here in its ``__init__``)."""

    config: ServerConfig
    policy: Policy
    store: ParameterStore
    tables: TableSet | None
    frozen: dict[str, Any]
    incarnation: str
    origin: str
    counters: Counters
    buffers: SharedBuffers
    members: Members
    applies: Applies
    arrival: Arrival
    saving: Saving
    _cond: threading.Condition
    _now: Callable[[], float]

    @property
    def membership(self) -> Membership:
        return self.members.membership

    @property
    def rounds(self) -> int:  # sync rounds completed
        return self.arrival.rounds

    cuts = property(lambda self: self.saving.cuts)  # Cuts[CoordinatorSnapshot]

    def _take_over(self, s: CoordinatorSnapshot) -> None:
        """Go on from ``s``: its workers with a fresh lease, the model and rounds as were."""
        self.members = Members.restored(self.config, self._now, s)  # logs it
        self.arrival = self._arrival(s)
        self.saving.resumed(s)
        self.counters.load(s.counters)

    def _arrival(self, s: CoordinatorSnapshot | None) -> Arrival:
        """The policy's strategy over the model, going on from ``s`` if given."""
        c, live = self.config, self.membership.live_ids()
        parts = (self.policy, self.store, self.tables, self.buffers, self.counters)
        clip = c.round_clip(self.tables is not None)
        return arrival(*parts, s, live, c.backup_workers, self.applies, clip)

    def _published(self) -> None:
        """After an apply published its gradients (under the lock): a cut may fall now."""
        self._settled(False)
        self._cond.notify_all()

    def _settled(self, round_ended: bool) -> None:
        """After a push or a departure: take the cut that falls now, if any (at the end of
        a sync round; otherwise once every live clock reaches it)."""
        if round_ended:
            cut = self.cuts.after_round(self.rounds)
        elif not self.applies.idle:
            return  # the cut waits until the weights hold every clock counted
        else:
            cut = self.cuts.reached(self.membership.min_clock())
        if cut is not None:
            self.saving.take(cut, self._snapshot(cut))

    def checkpoint_state(self, whole: bool = False) -> Any:
        """A consistent copy of everything a resumed server needs (see ``checkpoint``), the
        gradients accepted applied first. ``whole``: instead, the flat weights and every
        table whole, copied, leaving the tables' changes for the next checkpoint."""
        with self.applies.lock, self._cond:
            if self.applies.drain():
                self._published()  # a cut may fall now: it is taken before this state
            if whole:
                tables = self.tables.state_dict() if self.tables is not None else None
                return self.store.weights.copy(), tables
            return self._snapshot(self.cuts.last)

    def _snapshot(self, cut: int) -> CoordinatorSnapshot:
        """Everything a resumed server needs, copied; the caller holds the lock."""
        return CoordinatorSnapshot(
            cut=cut,
            policy=self.policy.name,
            incarnation=self.incarnation,
            counters=self.counters.state(),
            frozen=self.frozen,  # constants: not copied
            **self.members.state(),
            **self.arrival.state(),
        )

    def rewind(self, snapshot: CoordinatorSnapshot, on_disk: Iterable[int], cause: str = ""):
        """Go back to a cut, as a new incarnation whose origin is ``cause`` (the restarted
        shard's): every call of the old one is refused (ABORTED, waiting pulls too), so
        workers join again at the cut's clocks."""
        with self.applies.lock, self._cond:
            self.incarnation = uuid.uuid4().hex[:12]
            self.origin = cause or self.incarnation
            self.applies.discard(WrongIncarnation("The server rewound before applying this push."))
            self.saving.rewound(snapshot.cut, on_disk)
            self._take_over(snapshot)
            self._cond.notify_all()
