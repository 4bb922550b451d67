"""A coordinator's state as a checkpoint holds it: ``CoordinatorSnapshot``, typed, and the
checkpoint's dict of it and back (see ``paramserver.server.disk.checkpoint`` for the keys).

The coordinator takes a snapshot (``Coordinator.checkpoint_state``, and a cut) and is built
from one (``Coordinator(..., snapshot=)``, or a rewind): each part of it comes from, and
goes back to, the part of the coordinator that owns it. This module imports none of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np


@dataclass(frozen=True)
class CoordinatorSnapshot:
    """Everything a resumed server needs, copied (``frozen``: constants, not copied). The
    fields are the checkpoint's keys, in its order; ``snapshot["cut"]`` reads one as the
    checkpoint's dict would."""

    weights: np.ndarray  # the flat parameters and buffers
    optimizer_state: dict[str, Any]  # the server optimizer's state_dict()
    version: int  # optimizer steps applied
    rounds: int  # sync rounds completed
    cut: int  # the clock (sync: the round) of the last cut
    policy: str  # the policy it was taken under
    incarnation: str  # the server process that took it
    members: list[dict[str, Any]]  # Membership.state()'s members
    membership: dict[str, Any]  # floor, joined_total, expired_total
    queue: dict[str, Any] | None  # BatchQueue.state(); None: no data plan
    sync_round: dict[str, Any]  # SyncRound.state(): the round in progress
    buffers: dict[str, Any]  # SharedBuffers.state(): each worker's latest values
    counters: dict[str, int]  # Counters.state()
    frozen: dict[str, Any]  # the frozen parameters; a checkpoint file keeps their names
    # the sparse tables (None: none): as taken, each table's changes since the last
    # snapshot (TableSet.take_changes); as read, the row files they are in (a
    # row_reader.RowChain), or in older checkpoints every table whole (TableSet.state_dict())
    tables: Any
    table_layouts: dict[str, Any] | None  # TableSet.layouts()
    row_round: dict[str, Any]  # RowRound.state(): the round's row gradients
    ledger: dict[str, Any] | None  # Ledger.state(); None in checkpoints from before it
    row_chain: list[str] | None = None  # the row folders of the tables, base first
    row_sums: dict[str, str] | None = None  # their manifests' SHA-256
    # the last sync round applied with its norm over the shards, and that total (a shard
    # restarted from the cut after it tells a shard still waiting on the round: norm_round)
    norm_last: tuple[int, float] = (-1, 0.0)

    KEYS: ClassVar[tuple[str, ...]]

    def __getitem__(self, key: str) -> Any:
        if key not in self.KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def as_dict(self) -> dict[str, Any]:
        """The checkpoint's dict: every key, the weights included (``checkpoint.save_server``
        turns them into its ``model_state_dict``)."""
        return {key: getattr(self, key) for key in self.KEYS}

    @classmethod
    def from_dict(
        cls, state: dict[str, Any], weights: np.ndarray | None = None
    ) -> CoordinatorSnapshot:
        """The snapshot in a checkpoint's dict (``weights``: its flat parameters and buffers,
        which a file holds in its ``model_state_dict``). Checkpoints from before a key get
        its empty value; a file's ``frozen`` (the names only) is not needed back."""
        rounds = int(state["rounds"])
        frozen = state.get("frozen")
        return cls(
            weights=state["weights"] if weights is None else weights,
            optimizer_state=state["optimizer_state"],
            version=int(state["version"]),
            rounds=rounds,
            cut=int(state.get("cut", rounds)),
            policy=str(state["policy"]),
            incarnation=str(state["incarnation"]),
            members=list(state["members"]),
            membership=dict(state["membership"]),
            queue=state["queue"],
            sync_round=state["sync_round"],
            buffers=state.get("buffers") or {},
            counters=state["counters"],
            frozen=frozen if isinstance(frozen, dict) else {},
            tables=state.get("tables"),
            table_layouts=state.get("table_layouts"),
            row_round=state.get("row_round") or {},
            ledger=state.get("ledger"),
            row_chain=state.get("row_chain"),
            row_sums=state.get("row_sums"),
            norm_last=tuple(state.get("norm_last") or (-1, 0.0)),  # type: ignore[arg-type]
        )


CoordinatorSnapshot.KEYS = tuple(f.name for f in dataclasses.fields(CoordinatorSnapshot))
