"""The coordinator's checkpoint calls: the state a checkpoint holds, the cuts waiting for
the disk, rewinds and restores, and what the checkpointer reports. A part of
``Coordinator`` (which it is mixed into), split out for size: its state and lock are the
coordinator's, declared here for the type checker."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from paramserver.server.state import capture, restore_into

if TYPE_CHECKING:
    from paramserver.server.coordinator import Coordinator
    from paramserver.server.cuts import Cuts
    from paramserver.server.membership import Membership
    from paramserver.server.saves import Saves
    from paramserver.server.store import ParameterStore


class Saving:
    """Checkpoints and cuts, under the coordinator's lock."""

    if TYPE_CHECKING:
        _cond: threading.Condition
        _started: bool
        cuts: Cuts
        saves: Saves
        store: ParameterStore
        membership: Membership
        incarnation: str

    def _whole(self) -> Coordinator:
        return cast("Coordinator", self)

    def checkpoint_state(self) -> dict[str, Any]:
        """A consistent copy of everything a resumed server needs (see ``checkpoint``)."""
        with self._cond:
            return capture(self._whole(), self.cuts.last)

    @property
    def cuts_pending(self) -> bool:
        return bool(self.cuts.pending)

    def oldest_cut(self) -> dict[str, Any] | None:
        """The oldest cut taken and not yet on disk; it stays taken until ``cut_on_disk``."""
        with self._cond:
            return self.cuts.oldest()

    def pending_cut(self, clock: int) -> dict[str, Any] | None:
        with self._cond:
            return self.cuts.pending_at(clock)

    def cut_on_disk(self, clock: int) -> None:
        """The cut at ``clock`` is written: it leaves memory, and pulls waiting for room
        go on."""
        with self._cond:
            self.cuts.on_disk(clock)
            self._cond.notify_all()

    def learn_common_cut(self, clock: int) -> None:
        """A worker says every shard has written the cut at ``clock`` (PullRequest)."""
        if clock > self.cuts.common:
            with self._cond:
                self.cuts.learn_common(clock)

    def rewind(self, state: dict[str, Any], weights: np.ndarray, on_disk: Iterable[int]) -> None:
        """Go back to a cut, as a new incarnation: every call of the old one is refused
        (ABORTED, waiting pulls too), so workers join again at the cut's clocks."""
        with self._cond:
            self.incarnation = uuid.uuid4().hex[:12]
            self.cuts.rewound(int(state["cut"]), on_disk)
            self.restore(state, weights)

    def restore(self, saved: dict[str, Any], weights: np.ndarray) -> None:
        """Take over the state of a checkpoint (``weights``: its flat parameters and
        buffers); see ``server/state.py``."""
        with self._cond:
            restore_into(self._whole(), saved, weights)
            self._started = bool(self.membership.members) or self.store.version > 0
            self.saves.version = self.store.version
            self._cond.notify_all()

    def saved(self, version: int, at: float) -> None:
        """Record that a checkpoint of ``version`` was written at wall time ``at``."""
        with self._cond:
            self.saves.succeeded(version, at)

    def save_failed(self, error: str, at: float) -> None:
        """Record that a checkpoint write failed at wall time ``at``."""
        with self._cond:
            self.saves.failed(error, at)
