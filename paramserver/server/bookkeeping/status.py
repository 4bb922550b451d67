"""The one status of a server: what the Status RPC, the Prometheus metrics and
``ServerApp.status()`` all read. Its fields are the StatusResponse's (a test checks).

``server_status`` reads the parts of whatever it is given (``Observed``: the coordinator
has them), so this module imports no coordinator.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from paramserver._proto import paramserver_pb2 as pb

if TYPE_CHECKING:
    from paramserver.config import ServerConfig
    from paramserver.policy.staleness import Policy
    from paramserver.server.bookkeeping.batch_queue import BatchQueue
    from paramserver.server.bookkeeping.cuts import Cuts
    from paramserver.server.bookkeeping.leases import Member, Membership
    from paramserver.server.bookkeeping.ledger import Ledger
    from paramserver.server.bookkeeping.store import ParameterStore
    from paramserver.server.bookkeeping.write_record import Saves
    from paramserver.sparse.tableset import TableSet


@dataclass(frozen=True)
class WorkerStatus:
    worker_id: str
    name: str
    rank: int
    clock: int
    last_seen_seconds: float  # since the worker's last call
    samples: int
    samples_per_second: float  # since it joined
    lag: int  # the fastest live clock minus this one
    row_cache_hits: int = 0
    row_cache_misses: int = 0


@dataclass(frozen=True)
class ServerStatus:
    """A consistent snapshot of the server (see the StatusResponse message for each field)."""

    version: int
    policy: str
    workers: tuple[WorkerStatus, ...]
    pushes_applied: int
    bytes_in: int
    bytes_out: int
    max_staleness: int
    staleness_histogram: dict[int, int]
    samples: int
    train_loss: float
    train_seconds: float
    incarnation: str
    model: str
    world_size: int
    workers_joined: int
    workers_expired: int
    uptime_seconds: float
    learning_rate: float
    batches_done: int
    batches_total: int
    pushes_skipped: int
    duplicates: int
    checkpoint_version: int
    checkpoint_age_seconds: float  # -1: none
    min_workers: int
    rounds: int
    pulls_answered: int
    barrier_wait_seconds: float
    rows_held: int = 0
    rows_pulled: int = 0
    rows_pushed: int = 0
    checkpoint_failures: int = 0
    checkpoint_failing_seconds: float = -1.0
    checkpoint_error: str = ""
    cuts_pending: int = 0
    cut_written: int = 0
    batches_applied: int = 0
    pushes_repeated: int = 0
    pushes_late: int = 0
    pushes_coalesced: int = 0
    apply_failures: int = 0
    pushes_compensated: int = 0
    pushes_uncompensated: int = 0
    tested_epoch: int = 0  # the server's own evaluation (Counters.tested); 0: none yet
    test_accuracy: float = math.nan
    test_loss: float = math.nan
    test_auc: float = math.nan
    evaluation_failures: int = 0
    test_perplexity: float = math.nan
    table_rows: dict[str, int] = field(default_factory=dict)  # rows held, by table
    # the tables' lifecycle counters, by table (sparse/lifecycle.py)
    table_admitted: dict[str, int] = field(default_factory=dict)
    table_evicted: dict[str, int] = field(default_factory=dict)
    table_dropped: dict[str, int] = field(default_factory=dict)
    table_reborn: dict[str, int] = field(default_factory=dict)

    def to_proto(self) -> pb.StatusResponse:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        workers = [pb.WorkerStatus(**dataclasses.asdict(w)) for w in fields.pop("workers")]
        return pb.StatusResponse(workers=workers, **fields)

    def as_dict(self) -> dict[str, Any]:
        """Plain values: workers as a list of dicts (``ServerApp.status()``)."""
        d = dataclasses.asdict(self)
        d["workers"] = list(d["workers"])
        d["staleness_histogram"] = dict(self.staleness_histogram)
        for name in TABLE_COUNTS:
            d[name] = dict(getattr(self, name))
        return d


class Tested(NamedTuple):
    """The global model's test figures after ``epoch`` (``auc``: NaN but for click models;
    ``accuracy``: NaN where the outputs are not classes)."""

    epoch: int
    accuracy: float
    loss: float
    auc: float = math.nan
    perplexity: float = math.nan  # of a sequence model's cross-entropy; else NaN


@dataclass
class Counters:
    """What the server has done, for Status."""

    pushes_applied: int = 0
    duplicates: int = 0
    skipped: int = 0
    late: int = 0  # sync gradients dropped: their round closed without them
    coalesced: int = 0  # gradients applied in one optimizer step with others
    apply_failures: int = 0  # gradients lost because the optimizer raised
    compensated: int = 0  # gradients delay-compensated (--delay-compensation)
    uncompensated: int = 0  # gradients it found no kept read for (applied as they came)
    pulls: int = 0
    barrier_wait_seconds: float = 0.0
    samples: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    max_staleness: int = 0
    histogram: Counter[int] = field(default_factory=Counter)
    train_loss: float = math.nan
    first_push: float | None = None
    last_push: float | None = None
    # the server's own evaluation after each epoch (``paramserver server --run-dir``): the
    # last one's figures, and the evaluations that raised; not saved (metrics.jsonl is)
    tested: Tested | None = None
    evaluation_failures: int = 0

    # what a checkpoint keeps of them
    SAVED = (
        "pushes_applied",
        "duplicates",
        "skipped",
        "late",
        "coalesced",
        "apply_failures",
        "compensated",
        "uncompensated",
        "samples",
        "bytes_in",
        "bytes_out",
        "max_staleness",
    )

    def state(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in self.SAVED}

    def load(self, state: dict[str, Any]) -> None:
        for key in self.SAVED:
            if key in state:
                setattr(self, key, int(state[key]))

    def push(self, samples: int, loss: float, now: float) -> None:
        """An applied gradient of ``samples`` samples whose batch had ``loss``."""
        self.pushes_applied += 1
        self.samples += samples
        self.first_push = now if self.first_push is None else self.first_push
        self.last_push = now
        if math.isfinite(loss):
            nan = math.isnan(self.train_loss)
            self.train_loss = loss if nan else 0.98 * self.train_loss + 0.02 * loss

    def pull(self, lag: int) -> None:
        """A pull answered with weights to compute on, ``lag`` iterations stale."""
        self.pulls += 1
        self.histogram[lag] += 1
        self.max_staleness = max(self.max_staleness, lag)


class Parts(Protocol):
    """The coordinator's parts that both a status and a pull read, under its lock."""

    @property
    def policy(self) -> Policy: ...
    @property
    def store(self) -> ParameterStore: ...
    @property
    def counters(self) -> Counters: ...
    @property
    def membership(self) -> Membership: ...
    @property
    def cuts(self) -> Cuts[Any]: ...
    @property
    def rounds(self) -> int: ...


class Observed(Parts, Protocol):
    """What a status is read from (the coordinator's parts), read under its lock."""

    @property
    def config(self) -> ServerConfig: ...
    @property
    def queue(self) -> BatchQueue | None: ...
    @property
    def tables(self) -> TableSet | None: ...
    @property
    def saves(self) -> Saves: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def incarnation(self) -> str: ...
    @property
    def started_at(self) -> float: ...


def worker_statuses(membership: Membership, now: float) -> tuple[WorkerStatus, ...]:
    """The live workers at monotonic time ``now``, by rank."""
    members: list[Member] = sorted(membership.members.values(), key=lambda m: m.rank)
    fastest = max((m.clock for m in members), default=0)
    return tuple(
        WorkerStatus(
            worker_id=m.worker_id,
            name=m.name,
            rank=m.rank,
            clock=m.clock,
            last_seen_seconds=now - m.last_seen,
            samples=m.samples,
            samples_per_second=membership.rate(m),
            lag=fastest - m.clock,
            row_cache_hits=m.row_cache[0],
            row_cache_misses=m.row_cache[1],
        )
        for m in members
    )


def server_status(c: Observed, now: float, wall: float) -> ServerStatus:
    """The status of coordinator ``c`` at monotonic time ``now`` and wall time ``wall``; the
    caller holds its lock."""
    n, tables = c.counters, c.tables
    tested = n.tested or Tested(0, math.nan, math.nan)
    trained = 0.0
    if n.first_push is not None and n.last_push is not None:
        trained = n.last_push - n.first_push
    return ServerStatus(
        version=c.store.version,
        policy=c.policy.name,
        workers=worker_statuses(c.membership, now),
        pushes_applied=n.pushes_applied,
        bytes_in=n.bytes_in,
        bytes_out=n.bytes_out,
        max_staleness=n.max_staleness,
        staleness_histogram=dict(n.histogram),
        samples=n.samples,
        train_loss=n.train_loss,
        train_seconds=trained,
        incarnation=c.incarnation,
        model=c.config.model,
        world_size=c.config.workers,
        workers_joined=c.membership.joined_total,
        workers_expired=c.membership.expired_total,
        uptime_seconds=now - c.started_at,
        learning_rate=c.store.lr,
        batches_done=c.queue.done if c.queue else 0,
        batches_total=c.queue.total if c.queue else 0,
        pushes_skipped=n.skipped,
        pushes_late=n.late,
        pushes_coalesced=n.coalesced,
        apply_failures=n.apply_failures,
        pushes_compensated=n.compensated,
        pushes_uncompensated=n.uncompensated,
        tested_epoch=tested.epoch,
        test_accuracy=tested.accuracy,
        test_loss=tested.loss,
        test_auc=tested.auc,
        test_perplexity=tested.perplexity,
        evaluation_failures=n.evaluation_failures,
        duplicates=n.duplicates,
        checkpoint_version=c.saves.version,
        checkpoint_age_seconds=-1.0 if c.saves.at is None else wall - c.saves.at,
        min_workers=c.config.start_workers,
        rounds=c.rounds,
        pulls_answered=n.pulls,
        barrier_wait_seconds=n.barrier_wait_seconds,
        rows_held=tables.held if tables is not None else 0,
        **_table_counts(tables),
        rows_pulled=tables.rows_pulled if tables is not None else 0,
        rows_pushed=tables.rows_pushed if tables is not None else 0,
        checkpoint_failures=c.saves.failures,
        checkpoint_failing_seconds=c.saves.failing_seconds(wall),
        checkpoint_error=c.saves.error,
        cuts_pending=len(c.cuts.pending),
        cut_written=c.cuts.written,
        batches_applied=c.ledger.applied,
        pushes_repeated=c.ledger.repeated,
    )


TABLE_COUNTS = ("table_rows", "table_admitted", "table_evicted", "table_dropped", "table_reborn")


def _table_counts(tables: TableSet | None) -> dict[str, dict[str, int]]:
    """``TABLE_COUNTS``: each table's rows held and lifecycle counters."""
    tallies = tables.tallies() if tables is not None else {}
    return {
        name: {table: t[name.removeprefix("table_")] for table, t in tallies.items()}
        for name in TABLE_COUNTS
    }
