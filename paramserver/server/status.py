"""The one status of a server: what the Status RPC, the Prometheus metrics and
``ServerApp.status()`` all read. Its fields are the StatusResponse's (a test checks)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from paramserver._proto import paramserver_pb2 as pb


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

    def to_proto(self) -> pb.StatusResponse:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        workers = [pb.WorkerStatus(**dataclasses.asdict(w)) for w in fields.pop("workers")]
        return pb.StatusResponse(workers=workers, **fields)

    def as_dict(self) -> dict[str, Any]:
        """Plain values: workers as a list of dicts (``ServerApp.status()``)."""
        d = dataclasses.asdict(self)
        d["workers"] = list(d["workers"])
        d["staleness_histogram"] = dict(self.staleness_histogram)
        return d
