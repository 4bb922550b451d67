"""A coordinator's state as a checkpoint holds it, and back (see ``paramserver.server.checkpoint``
for the keys). The caller holds the coordinator's lock."""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from paramserver.server.dataplan import BatchQueue
from paramserver.server.ledger import Ledger
from paramserver.server.membership import Membership
from paramserver.server.rounds import SyncRound
from paramserver.sparse.tableset import RowRound

if TYPE_CHECKING:
    from paramserver.server.coordinator import Coordinator

log = logging.getLogger(__name__)


def capture(c: Coordinator, cut: int) -> dict[str, Any]:
    """Everything a resumed server needs, copied."""
    members = c.membership.state()
    return {
        "weights": c.store.weights.copy(),
        "optimizer_state": copy.deepcopy(c.store.optimizer.state_dict()),
        "version": c.store.version,
        "rounds": c.rounds,
        "cut": cut,
        "policy": c.policy.name,
        "incarnation": c.incarnation,
        "members": members.pop("members"),
        "membership": members,
        "queue": c.queue.state() if c.queue is not None else None,
        "sync_round": c.round.state(),
        "buffers": c.buffers.state(),
        "counters": c.counters.state(),
        "frozen": c.frozen,  # constants: not copied
        "tables": c.tables.state_dict() if c.tables is not None else None,
        "table_layouts": c.tables.layouts() if c.tables is not None else None,
        "row_round": c.row_round.state(),
        "ledger": c.ledger.state(),
    }


def restore_into(c: Coordinator, state: dict[str, Any], weights: np.ndarray) -> None:
    """Take over the state of a checkpoint (``weights``: its flat parameters and buffers).

    The checkpoint's workers come back as live members with a fresh lease: a worker that
    rejoins with its id goes on from its checkpointed clock; one that does not come back
    within the lease is dropped, and the batches it held go to the others.
    """
    if state["policy"] != c.policy.name:
        log.warning("the checkpoint was written under %s; going on under %s",
                    state["policy"], c.policy.name)  # fmt: skip
    c.store.restore(weights, state["optimizer_state"], int(state["version"]))
    c.rounds = int(state["rounds"])
    c.cuts.last = int(state.get("cut", c.rounds))
    c.membership = Membership.from_state(
        {"members": state["members"], **state["membership"]},
        c.config.workers,
        c.config.lease_seconds,
        c.membership.now,
    )
    q = state["queue"]
    c.queue = BatchQueue.from_state(q) if q is not None else None
    live = c.membership.live_ids()
    if c.policy.synchronous:
        c.round = SyncRound.from_state(state["sync_round"], live)
        c.row_round = RowRound.from_state(state.get("row_round") or {})
    if c.tables is not None:
        if state.get("tables") is None:
            raise ValueError("The checkpoint holds no sparse tables, but this model has some.")
        c.tables.load_state_dict(state["tables"])
    c.ledger = Ledger.from_state(state.get("ledger"))
    c.counters.load(state["counters"])
    c.buffers.load(state.get("buffers"), live)
    log.info("resumed from incarnation %s at version %d with %d workers",
             state["incarnation"], c.store.version, len(c.membership.members))  # fmt: skip
