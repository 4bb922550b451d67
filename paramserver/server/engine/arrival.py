"""What of a push reaches the model, and when: the one place the staleness policies differ
on the server's side, as a strategy the coordinator chooses once (``arrival``).

Every push goes through ``Arrival.take``: a gradient of batches this shard applied already
(``bookkeeping/ledger.py``) or a non-finite one (``--skip-nonfinite``) counts for the
worker's clock and reaches nothing; the buffers' values after it are recorded; then:

- ``Rounds`` (``sync``): the gradient joins the round in progress (``SyncRound``, and its
  rows ``RowRound``); when every live worker has pushed, the round's mean is applied, the
  shared buffers are those of the round's givers, and a cut may fall at the round's end.
  A newcomer starts at the current round; a pull with no batch left is answered (batch -1:
  an empty push still counts for the round).
- ``OnArrival`` (``ssp:K``, ``async``): the gradient goes to the optimizer as it arrives,
  which steps off the coordinator's lock (``server/engine/dense_apply.py``: ``take`` gives back what
  the pusher waits for), and the shared buffers are those of the live workers; cuts come
  when every live clock reaches one and every accepted gradient is applied. A newcomer
  starts at the slowest live clock; a pull with no batch left waits for one (a batch given
  back) or for the end of the run.

Decisions and bookkeeping only: no lock (the coordinator calls under its own), no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from paramserver.codec.idle import Idle
from paramserver.codec.rows import RowGradients
from paramserver.policy import staleness
from paramserver.policy.staleness import Policy
from paramserver.server.bookkeeping import norm_round
from paramserver.server.bookkeeping.buffers import SharedBuffers
from paramserver.server.bookkeeping.ledger import Ledger
from paramserver.server.bookkeeping.norm_round import Closing
from paramserver.server.bookkeeping.snapshot import CoordinatorSnapshot
from paramserver.server.bookkeeping.status import Counters
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.bookkeeping.sync_round import SyncRound
from paramserver.server.engine.dense_apply import Applies, Pending
from paramserver.sparse.row_round import RowRound
from paramserver.sparse.tableset import TableSet

log = logging.getLogger("paramserver.server.engine.coordinator")

LATE_LOG_EVERY = 100  # a straggler is late round after round: a line per this many drops


class Arrival:
    """What both strategies share: the model they update, the batches applied, and the
    rounds completed (kept under every policy, so a checkpoint moves between them)."""

    in_rounds = False  # cuts fall at the end of rounds (``Cuts.synchronous``)
    clip = 0.0  # --clip-grad-norm where a step's norm spans more than the dense part here
    waits_for_batch = True  # a pull with no batch left waits for one, or for the end

    def __init__(
        self,
        store: ParameterStore,
        tables: TableSet | None,
        buffers: SharedBuffers,
        counters: Counters,
        ledger: Ledger | None = None,
        rounds: int = 0,
        round_: SyncRound | None = None,
        row_round: RowRound | None = None,
        applies: Applies | None = None,
    ):
        self.store, self.tables, self.buffers, self.counters = store, tables, buffers, counters
        # where an applied gradient waits for the optimizer (OnArrival)
        self.applies = applies or Applies(store)
        # the server-handed batches this shard applied (each once, whoever pushes it)
        self.ledger = ledger or Ledger()
        self.rounds = rounds  # sync rounds completed
        self.round = round_ or SyncRound()  # the sync round in progress
        self.row_round = row_round or RowRound()  # its row gradients

    def take(
        self,
        worker_id: str,
        iteration: int,
        grad: np.ndarray | None,
        rows: list[RowGradients],
        finite: bool,
        batches: Sequence[int],
        live: list[str],
        idle: Idle = (),
        norm_sq: float | None = None,
    ) -> tuple[bool, Pending | None]:
        """Take in an accepted push of ``batches`` (``grad`` None: an empty push; ``rows``:
        its tables' checked rows; ``idle``: its parameters without a gradient; ``norm_sq``:
        its squared norm over the whole model); whether a gradient of it reaches the model,
        and the gradient waiting for the optimizer (the pusher applies it, or waits until
        someone has: ``Coordinator``), if any.

        Raises:
            InvalidRequest: it names batches of which this shard applied some, not all.
        """
        if grad is not None and self.ledger.seen(batches, f"Worker {worker_id}'s push"):
            self.ledger.repeated += 1
            log.warning(
                "worker %s pushed batches %s, which this shard applied already: counted for "
                "its clock, not applied", worker_id, list(batches),
            )  # fmt: skip
            grad, rows, finite = None, [], True
        if not finite:
            self.counters.skipped += 1
            log.warning("skipped the non-finite gradient of worker %s for iteration %d",
                        worker_id, iteration)  # fmt: skip
            grad, rows = None, []
        elif grad is not None:  # its buffers' values follow the parameters' gradient
            self.counters.bytes_in += grad.nbytes
            self.buffers.record(worker_id, grad[self.store.n_params :])
            grad = grad[: self.store.n_params]
        waiting = self.arrive(worker_id, iteration, grad, rows, live, idle, norm_sq)
        if grad is not None or not finite:  # a skipped gradient's batches are spent
            self.ledger.add(batches)
        return grad is not None, waiting

    @classmethod
    def round_in(
        cls, saved: CoordinatorSnapshot, live: Sequence[str]
    ) -> tuple[SyncRound | None, RowRound | None]:
        """The round in progress that a snapshot holds, as this strategy goes on with it
        (none: one resumed under another policy is dropped)."""
        return None, None

    def start_clock(self) -> int | None:
        """Where a worker that joins when none is live starts (None: the slowest clock seen)."""
        return None

    def late(self, worker_id: str, iteration: int) -> bool:
        """Whether a push comes too late to count (only a sync round with backups closes
        without some worker's push)."""
        return False

    def arrive(
        self,
        worker_id: str,
        iteration: int,
        grad: np.ndarray | None,
        rows: list[RowGradients],
        live: list[str],
        idle: Idle = (),
        norm_sq: float | None = None,
    ) -> Pending | None:
        """``grad``, the parameters' gradient (None: nothing reaches the model), and ``rows``
        of ``worker_id``'s push; the gradient as it waits for the optimizer, if it does."""
        raise NotImplementedError

    def settle(self, live: list[str]) -> bool:
        """After a push: whether a round ended (so a cut may fall at it)."""
        return False

    def left(self, live: list[str]) -> bool:
        """After workers left (``live``: those still here): whether a round ended."""
        return False

    def waiting(self, round_: int) -> Closing | None:
        """The round closing for its norm, if it is ``round_`` or earlier (``Rounds``)."""
        return None

    @property
    def between_rounds(self) -> bool:
        """No push in the round in progress, and none closing for its norm."""
        return not self.round.contributors and self.waiting(self.rounds) is None

    last: tuple[int, float] = (-1, 0.0)  # Rounds': the last round finished, its total

    def finish(self, round_: int, total: float) -> bool:
        return False  # no round waits for its norm but under sync (``Rounds``)

    def share(self, workers: Iterable[str]) -> None:
        """The model's buffers become the combined latest values of ``workers``."""
        if not self.buffers.size:  # a model (or shard) without buffers: nothing to share
            return
        values = self.buffers.combine(workers)
        if values is not None:
            self.store.set_buffers(values)

    def state(self) -> dict[str, Any]:
        """The snapshot's model side, copied: weights, optimizer, version, the tables' rows
        changed since the last snapshot, buffers, the batches applied and the rounds."""
        store, tables = self.store, self.tables
        return {
            "weights": store.weights.copy(),
            "optimizer_state": store.optimizer_state(),
            "version": store.version,
            "rounds": self.rounds,
            "sync_round": self.round.state(),
            "buffers": self.buffers.state(),
            "tables": tables.take_changes() if tables is not None else None,
            "table_layouts": tables.layouts() if tables is not None else None,
            "row_round": self.row_round.state(),
            "ledger": self.ledger.state(),
            "norm_last": self.last,
        }


class OnArrival(Arrival):
    """``ssp:K`` and ``async``: each gradient is applied as it arrives."""

    def arrive(
        self,
        worker_id: str,
        iteration: int,
        grad: np.ndarray | None,
        rows: list[RowGradients],
        live: list[str],
        idle: Idle = (),
        norm_sq: float | None = None,
    ) -> Pending | None:
        if grad is None:
            return None
        factor = norm_round.push_factor(self.clip, norm_sq) if self.clip else None
        if self.tables is not None:  # at this step's rate (--lr-schedule); no rows: the TTL
            step = self.applies.next_version
            self.tables.apply(norm_round.times(rows, factor) or [], self.store.rate(step), step)
        waiting = self.applies.add(worker_id, grad, iteration, idle, factor)
        self.share(live)
        return waiting

    def left(self, live: list[str]) -> bool:
        self.share(live)
        if self.applies.reads is not None:
            self.applies.reads.forget(live)
        return False


class Rounds(Arrival):
    """``sync``: gradients are averaged over a round of every live worker's push, or with
    ``backups`` B of all live workers' but B (``--backup-workers``). With ``clip`` (a
    step's norm spanning more than this server's dense part: ``norm_round.py``) a complete
    round closes (``closing``) until its norm's total is known: at once on one server, from
    a worker's ``finish`` with ``relay`` (shards); it counts as ended for lateness and
    newcomers meanwhile, and the next one cannot close."""

    in_rounds = True
    waits_for_batch = False  # batch -1: the empty push counts for the round
    backups = 0
    relay = False
    closing: Closing | None = None

    @property
    def ended(self) -> int:
        """The rounds complete: applied, and the one closing."""
        return self.rounds + (self.closing is not None)

    def late(self, worker_id: str, iteration: int) -> bool:
        """Whether the push of ``iteration`` comes after its round closed without it: it is
        dropped and counted (the caller gives its batches back)."""
        if not staleness.late(iteration, self.ended):
            return False
        self.counters.late += 1
        if self.counters.late == 1 or self.counters.late % LATE_LOG_EVERY == 0:
            log.info(
                "dropped worker %s's gradient for round %d, which closed without it (%d so "
                "far; --backup-workers %d)", worker_id, iteration, self.counters.late, self.backups,
            )  # fmt: skip
        return True

    @classmethod
    def round_in(
        cls, saved: CoordinatorSnapshot, live: Sequence[str]
    ) -> tuple[SyncRound | None, RowRound | None]:
        """The snapshot's round less its contributors that are not ``live``."""
        return (
            SyncRound.from_state(saved.sync_round, list(live)),
            RowRound.from_state(saved.row_round or {}),
        )

    def start_clock(self) -> int | None:
        return self.ended

    def arrive(
        self,
        worker_id: str,
        iteration: int,
        grad: np.ndarray | None,
        rows: list[RowGradients],
        live: list[str],
        idle: Idle = (),
        norm_sq: float | None = None,
    ) -> Pending | None:
        self.round.add(worker_id, grad, idle)
        self.row_round.add(rows)
        return None

    def settle(self, live: list[str]) -> bool:
        """Apply the round's mean if every live worker (but the backups) has pushed (with
        ``clip``: close it, and apply it once its norm is known)."""
        if self.closing is not None or not self.round.complete(live, self.backups):
            return False
        self.share(self.round.givers)
        n, idle = self.round.n, self.round.idle or ()
        pushed = (sorted(self.round.contributors), sorted(self.round.givers))
        mean = self.round.take_mean()
        rows = self.row_round.take_mean(n) if self.tables is not None and n else None
        if not self.clip:
            self._apply(mean, rows, idle, None)
            return True
        if self.relay and mean is not None:  # the next round's sum may reuse its buffer
            mean = mean.copy()
        part = norm_round.part_of(mean, rows)
        self.closing = Closing(self.rounds, mean, rows, idle, part, n, pushed)
        return not self.relay and self.finish(self.rounds, self.closing.part)

    def waiting(self, round_: int) -> Closing | None:  # the round closing, if <= round_
        return self.closing if self.closing and self.closing.round <= round_ else None

    def state(self) -> dict[str, Any]:
        out = super().state()
        if self.closing is not None:  # complete and not applied: a resumed server closes it
            out.update(self.closing.round_state())
        return out

    def finish(self, round_: int, total: float) -> bool:
        """Apply round ``round_`` if it is the one closing, clipped by ``total`` (its squared
        norm over every shard); whether it did (InvalidRequest: ``norm_round.check_total``)."""
        c = self.closing
        if c is None or c.round != round_:
            return False
        norm_round.check_total(total, c.part)
        self.closing, self.last = None, (round_, total)
        factor = norm_round.scale(self.clip, total)
        self._apply(c.mean, norm_round.times(c.rows, factor), c.idle, factor)
        return True

    def _apply(
        self, mean: np.ndarray | None, rows: list[RowGradients] | None, idle: Idle, factor: float | None
    ) -> None:  # fmt: skip
        if rows is not None:
            self.tables.apply(rows, self.store.lr, self.store.version + 1)  # type: ignore[union-attr]
        if mean is not None:
            self.store.apply(mean, idle, factor)
        self.rounds += 1

    def left(self, live: list[str]) -> bool:
        # A departed worker's gradient already in the round stays: it is valid work.
        return self.settle(live)


def arrival(
    policy: Policy,
    store: ParameterStore,
    tables: TableSet | None,
    buffers: SharedBuffers,
    counters: Counters,
    saved: CoordinatorSnapshot | None = None,
    live: Sequence[str] = (),
    backups: int = 0,
    applies: Applies | None = None,
    clip: tuple[float, bool] = (0.0, False),
) -> Arrival:
    """The strategy of ``policy`` over the model (``store``, ``tables``, ``buffers``). With a
    snapshot ``saved`` the model goes on from it: its weights, optimizer state, tables, the
    buffers of the ``live`` workers, the batches applied and the rounds (the round in
    progress less the contributors not ``live``; one resumed under another policy is
    dropped). ``clip``: ``Arrival.clip`` and ``Rounds.relay``.

    Raises:
        ValueError: the model has sparse tables and the snapshot none.
    """
    chosen = Rounds if policy.synchronous else OnArrival
    made = _made(chosen, store, tables, buffers, counters, saved, live)
    made.applies = applies or made.applies
    made.clip = clip[0]
    if isinstance(made, Rounds):
        made.backups, made.relay = backups, clip[1]
        made.last = saved.norm_last if saved is not None else made.last
    return made


def _made(
    chosen: type[Arrival],
    store: ParameterStore,
    tables: TableSet | None,
    buffers: SharedBuffers,
    counters: Counters,
    saved: CoordinatorSnapshot | None,
    live: Sequence[str],
) -> Arrival:
    if saved is None:
        return chosen(store, tables, buffers, counters)
    store.restore(saved.weights, saved.optimizer_state, saved.version)
    if tables is not None:
        if saved.tables is None:
            raise ValueError("The checkpoint holds no sparse tables, but this model has some.")
        if hasattr(saved.tables, "restore"):  # the row files it names (``disk/row_format.py``)
            saved.tables.restore(tables)
        else:  # an older checkpoint's: every table whole
            tables.load_state_dict(saved.tables)
    buffers.load(saved.buffers, live)
    ledger = Ledger.from_state(saved.ledger)
    return chosen(
        store, tables, buffers, counters, ledger, saved.rounds, *chosen.round_in(saved, live)
    )
