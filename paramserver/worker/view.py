"""What a ``Worker`` says about itself: its id, rank, clock and incarnation (shard 0's),
its shards and rejoins, shard 0's Status and the batches its pushes landed, and how its
steps move (``StepMode``)."""

from __future__ import annotations

from paramserver._proto import paramserver_pb2 as pb
from paramserver.policy.staleness import Policy
from paramserver.worker.pipeline import Pipeline, StepMode, step_mode
from paramserver.worker.session import Session


class WorkerView:
    sessions: list[Session]
    _pipe: Pipeline
    overlap: bool
    policy: Policy

    @property
    def worker_id(self) -> str:
        return self.sessions[0].worker_id

    @property
    def rank(self) -> int:
        return self.sessions[0].rank

    @property
    def clock(self) -> int:
        """The iteration this worker computes next (shard 0's clock)."""
        return self.sessions[0].clock

    @property
    def incarnation(self) -> str:
        return self.sessions[0].incarnation

    @property
    def shards(self) -> int:
        return len(self.sessions)

    @property
    def rejoins(self) -> int:
        return sum(s.rejoins for s in self.sessions)

    def landed_batches(self) -> list[tuple[int, ...]]:
        """The batches of each push shard 0 took since the last call (``--batch-log``;
        kept from the first call on): ``pushes.Landed``."""
        return self._pipe.landed.take()

    def name_next_batches(self) -> None:
        """From the next pull on, each pull also names the batches of the iteration after
        it (``next_batches``), taken for this worker then (overlapped local steps)."""
        self.sessions[0].ahead = True

    def status(self) -> pb.StatusResponse:
        """Shard 0's Status (its batches and samples are the run's)."""
        return self.sessions[0].status()

    @property
    def shm_active(self) -> bool:
        """Whether every shard's payloads go through a shared segment its server mapped."""
        return all(s.channel.shm for s in self.sessions)

    @property
    def page_locked(self) -> bool:
        """Whether every shard's payload buffers are page-locked (a CUDA worker's shared
        segments registered with CUDA; ``transport/pinned.py``)."""
        return all(getattr(s.channel, "page_locked", False) for s in self.sessions)

    @property
    def control_active(self) -> bool:
        """Whether every shard's steps go over its server's same-host control socket."""
        return all(getattr(s.channel, "control", None) for s in self.sessions)

    @property
    def data_port_active(self) -> bool:
        """Whether every shard's payloads go over its server's data port (and it has not
        failed since the last Join)."""
        return all(getattr(s.channel, "data_port", False) for s in self.sessions)

    @property
    def mode(self) -> StepMode:
        return step_mode(self.overlap, self.shm_active, self.policy.synchronous)

    @property
    def prefetching(self) -> bool:
        """Whether the next weights are fetched while the model computes."""
        return self.mode is StepMode.PREFETCHING
