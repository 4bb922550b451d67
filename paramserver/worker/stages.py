"""The stages of one step (``Worker.step`` runs them in order), each an object chosen for how
the worker steps, so that the step itself has one path:

- ``Stager``: copies the gradients into a free push slot of every range (one copy; none
  where the channel sends from the gradients themselves: the data port; for a flat
  replica, none for the buckets that went to a free slot during backward), with
  the tables' rows, zeroes them and advances every session's clock: a ``StagedPush``.
- ``Exchange``: moves the staged push and brings the next weights, one kind per
  ``StepMode``: ``Blocking`` (a push and the next pull in one round trip a shard),
  ``Overlapped`` (the push in the background while the pull waits in the foreground) and
  ``Prefetching`` (this step's weights were fetched while it computed; its push goes out
  with the fetch of the next). Each falls back to pushing in the background and pulling when
  a session is lost, on the last push, or when nothing was fetched ahead. The worker picks
  one again whenever its channels reopen (a rejoin may lose shared memory, and with it
  prefetching).
- ``Loader``: takes every range's pulled weights into the model (``unflatten_into``, one
  copy). ``Binder``, for blocking steps: the model's tensors are views of the buffers the
  channels receive weights into (``Replica.bind``), which a pull writes in place; the rest
  are copied.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence

import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression
from paramserver.codec.idle import MAX_RANGES, Idle, ranges
from paramserver.codec.rows import RowGradients
from paramserver.errors import RejoinRequired
from paramserver.worker.flat import FlatReplica
from paramserver.worker.pipeline import Pipeline, StepMode
from paramserver.worker.pushes import StagedPush
from paramserver.worker.replica import Replica
from paramserver.worker.rows import WorkerTables
from paramserver.worker.session import Session

Headers = list[pb.PullHeader]


class Stager:
    """Stages a step's push into the channels' push slots of every range."""

    def __init__(
        self,
        sessions: Sequence[Session],
        ranges: Sequence[tuple[int, int]],
        replica: Replica,
        tables: WorkerTables,
        pipe: Pipeline,
        codec: type[compression.Codec] | None = None,
    ):
        self.parts = list(zip(sessions, ranges, strict=True))
        # a push keeps a residual (--compress topk, int8, fp16, bf16): a parameter without
        # a gradient is pushed as zeros, so that its residual still goes out (the server
        # would leave the range alone, and the residual be lost)
        self.feedback = codec is not None and issubclass(codec, compression.Feedback)
        # the servers clip each push by its norm over the whole model (JoinResponse.push_norm)
        self.norms = any(s.reply.push_norm for s in sessions)
        self.sessions, self.replica, self.tables, self.pipe = list(sessions), replica, tables, pipe
        self._early: int | None = None  # the slot gradients went to during backward
        if isinstance(replica, FlatReplica):
            replica.early = self._early_buffers

    def _early_buffers(self) -> list[tuple[int, int, torch.Tensor]] | None:
        """During backward: a free slot's buffers for the gradients ready (none if no slot
        is free yet; ``stage`` takes one then)."""
        if self._early is None:
            self._early = self.pipe.try_take_slot()
        if self._early is None:
            return None
        return [(lo, hi, s.channel.slots[self._early]) for s, (lo, hi) in self.parts]

    def cancel(self) -> None:
        """The step is dropped: give back the slot its gradients went to, if any."""
        if self._early is not None:
            self.pipe.release(self._early)
            self._early = None

    def stage(self, samples: int, loss: float, empty: bool, batches: Iterable[int]) -> StagedPush:
        """Copy the gradients into a free push slot of every range (none if ``empty``), zero
        them and advance every session's clock."""
        self.replica.check_trainable()  # before a slot is taken: a refusal leaves none held
        slot = self.pipe.take_slot() if self._early is None else self._early
        self._early = None
        idle: dict[int, Idle] = {}
        if not empty:
            spans = [] if self.feedback else self.replica.idle()
            if 0 < len(spans) <= MAX_RANGES:  # more: pushed as zeros, as before
                idle = {s.reply.shard: ranges(spans, lo, hi) for s, (lo, hi) in self.parts}
            self.replica.stage(self._copied(slot))
        rows = self.tables.stage(len(self.sessions)) if self.tables and not empty else {}
        norm_sq = _norm_sq(self.replica.params, rows) if self.norms and not empty else None
        clocks = tuple(s.clock for s in self.sessions)
        cache = self.tables.counters
        staged = StagedPush(
            slot,
            clocks,
            samples,
            loss,
            empty,
            rows,
            (cache.hits, cache.misses),
            () if empty else tuple(batches),
            idle,
            norm_sq,
        )
        for s in self.sessions:
            s.clock += 1
        self.replica.zero_grad()
        return staged

    def _copied(self, slot: int) -> list[tuple[int, int, torch.Tensor]]:
        """The ranges whose channel needs the gradients copied into its slot; the others
        took them as they are (``Channel.stage``: a data port sends from the gradients)."""
        copied = []
        for s, (lo, hi) in self.parts:
            buffer = s.channel.slots[slot]
            pieces = self.replica.pieces(lo, hi, buffer.dtype) if s.channel.takes_pieces else None
            if not s.channel.stage(slot, pieces):
                copied.append((lo, hi, buffer))
        return copied


def _norm_sq(params: Sequence[torch.Tensor], rows: dict[int, tuple[RowGradients, ...]]) -> float:
    """The squared L2 norm of a step's gradients and every shard's rows, in float64 (before
    any lossy --compress: ``norm_round.py``)."""
    total = 0.0
    for g in [p.grad for p in params if p.grad is not None]:
        total += float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2
    for part in rows.values():
        for r in part:
            total += float(torch.linalg.vector_norm(r.grads, dtype=torch.float64)) ** 2
    return total


class Exchange(abc.ABC):
    """How a step's push and the next pull travel over ``pipe``; ``batches``: the batches
    each pull asks for (``push_every``)."""

    mode: StepMode

    def __init__(self, pipe: Pipeline, batches: int):
        self.pipe = pipe
        self.batches = batches

    def landed(self) -> Headers | None:
        """Before the step stages its push: the weights fetched ahead for it, if any."""
        return None

    @abc.abstractmethod
    def send(self, staged: StagedPush, ready: Headers | None, pull: bool) -> Headers | None:
        """Send ``staged`` (``ready``: what ``landed`` gave). The headers of the next weights
        when they are in the channels now: the worker loads them, then calls ``then``. None:
        the push is sent or dropped, and the worker pulls (if ``pull``)."""

    def then(self, staged: StagedPush | None) -> None:  # noqa: B027 - only prefetch sends
        """Once the next weights are in the model: what goes out while it computes
        (``staged``: the push that has not gone yet, if any)."""

    def _lost(self) -> bool:
        return any(s.lost for s in self.pipe.sessions)

    def _in_background(self, staged: StagedPush, wait: bool) -> None:
        """Push from the background; ``wait``: until every push has been answered (a lost
        session's is dropped: the pull joins it again)."""
        self.pipe.push_background(staged)
        if wait:
            self.pipe.flush()
            self.pipe.check()


class Blocking(Exchange):
    """Push and pull the next weights in one round trip a shard, before the model computes."""

    mode = StepMode.BLOCKING

    def send(self, staged: StagedPush, ready: Headers | None, pull: bool) -> Headers | None:
        if pull and not self._lost():
            try:
                return self.pipe.push_pull(staged, self.batches)
            except RejoinRequired:
                return None  # that shard's push is dropped; it goes on from its clock
        self._in_background(staged, wait=True)
        return None


class Overlapped(Exchange):
    """Push in the background while the next pull waits for the policy."""

    mode = StepMode.OVERLAPPED

    def send(self, staged: StagedPush, ready: Headers | None, pull: bool) -> Headers | None:
        self._in_background(staged, wait=self._lost())
        return None


class Prefetching(Exchange):
    """The weights for this step were fetched while the last one computed; this step's push
    and the fetch for the step after it go out together while it computes."""

    mode = StepMode.PREFETCHING

    def landed(self) -> Headers | None:
        return self.pipe.wait_ahead()

    def send(self, staged: StagedPush, ready: Headers | None, pull: bool) -> Headers | None:
        if ready is not None and pull and not self._lost():
            return ready
        self._in_background(staged, wait=True)
        return None

    def then(self, staged: StagedPush | None) -> None:
        self.pipe.start_ahead(staged, self.batches)


EXCHANGES: dict[StepMode, type[Exchange]] = {
    e.mode: e  # type: ignore[type-abstract]
    for e in (Blocking, Overlapped, Prefetching)
}


def exchange(mode: StepMode, pipe: Pipeline, batches: int) -> Exchange:
    return EXCHANGES[mode](pipe, batches)


class Loader:
    """Takes every range's pulled weights into the model (one copy)."""

    def __init__(
        self, replica: Replica, sessions: Sequence[Session], ranges: Sequence[tuple[int, int]]
    ):
        self.replica = replica
        self.parts = list(zip(sessions, ranges, strict=True))

    def reopened(self) -> None:
        """The channels' payload paths opened (again): new buffers."""

    def load(self) -> None:
        self.replica.load([(lo, hi, s.channel.weights) for s, (lo, hi) in self.parts])


class Binder(Loader):
    """Blocking steps: the model's tensors are views of the channels' weights (a shared
    segment's, or the buffer a data port or a gRPC stream receives into), so a pull writes
    them in place; ``load`` copies only the rest (a tensor straddling shards, one on a GPU).

    A pull that fails halfway has written part of the model: ``Worker.pull`` pulls again
    before anything computes, and a failure it gives up on leaves the model to be pulled."""

    def reopened(self) -> None:
        self.replica.bind([(lo, hi, s.channel.weights) for s, (lo, hi) in self.parts])


def loader(
    mode: StepMode, replica: Replica, sessions: Sequence[Session], ranges: Sequence[tuple[int, int]]
) -> Loader:
    """Views where nothing computes while a pull lands (blocking steps), else copies."""
    return (Binder if mode is StepMode.BLOCKING else Loader)(replica, sessions, ranges)
