"""Each shard's payload path: a session joins offering buffers for its range of the model's
flat buffer (a shared segment; the streams' buffers otherwise), and its channel opens the
path the server accepted. Lost sessions join again the same way, under their ids, and after
a shard restarted every shard is brought back to one cut (``shards.rewind_ahead``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression
from paramserver.codec.layout import Manifest
from paramserver.errors import ConfigError
from paramserver.transport.channels import StreamBuffers
from paramserver.transport.client import PayloadSpec
from paramserver.worker.session import Session
from paramserver.worker.shards import rewind_ahead, served_range

log = logging.getLogger(__name__)


class Attacher:
    """Attaches ``sessions[i]`` over ``ranges[i]`` of the flat buffer ``manifest`` lays out.

    Args:
        sessions, ranges: one each per shard, in shard order.
        manifest: the local model's flat buffer.
        slots: push slots (pushes in flight at most).
        device: the model's (for CUDA, every payload buffer is page-locked: the streams' and
            the data port's, and the shared segment, registered: ``transport/pinned.py``).
        codec: the codec of streamed gradients (made for each range's size).
        shm: offer each server a shared segment.
        control: with shared memory, step over the server's control socket if it offers one.
        remote: without it, use the server's data port if it offers one.
        train_samples: what shard 0's Join says of the worker's data set.
    """

    def __init__(
        self,
        sessions: Sequence[Session],
        ranges: Sequence[tuple[int, int]],
        manifest: Manifest,
        slots: int,
        device: torch.device,
        codec: type[compression.Codec],
        shm: bool,
        control: bool,
        remote: bool,
        train_samples: int,
    ):
        self.sessions, self.ranges, self.manifest = list(sessions), list(ranges), manifest
        self.slots, self.codec, self.shm, self.control = slots, codec, shm, control
        self.remote = remote
        self.train_samples = train_samples
        self.buffers = StreamBuffers(manifest.numel, slots, device, manifest.torch_dtype)
        self.codecs: dict[int, compression.Codec] = {}  # each session's, for this join

    def spec(self, i: int) -> PayloadSpec:
        """Session i's payloads: its range, the streams' views of it, and a fresh codec
        (a rejoin drops what the last one held back: top-k's or int8's residual, logged)."""
        lo, hi = self.ranges[i]
        old = self.codecs.get(i)
        if isinstance(old, compression.Feedback):
            held, kind = float(old.residual.norm()), "top-k" if old.topk else old.name
            log.info("shard %d: joining again drops the %s residual (norm %.3g)", i, kind, held)
        self.codecs[i] = self.codec(
            hi - lo,
            self.manifest.exact_tail(lo, hi),
            self.manifest.dtype,
            self.manifest.dense_tail(lo, hi),
        )
        return PayloadSpec(
            self.manifest.itemsize * (hi - lo),
            self.manifest.dtype,
            self.slots,
            self.buffers.views(lo, hi),
            self.codecs[i],
            self.shm,
            self.control,
            self.sessions[i].rpc_timeout,
            self.remote,
            pinned=self.buffers.pinned,
        )

    def attach(self, i: int, retry: bool) -> None:
        """Join session i (again) under its id, offering buffers for its range, and open its
        channel's payload path. ``retry``: a rejoin, retried while the server is away."""
        request = pb.JoinRequest(train_samples=self.train_samples if i == 0 else 0)
        check = functools.partial(self._same_range, i) if retry else None
        self.sessions[i].attach(request, self.spec(i), retry, check)

    def attach_all(self) -> None:
        for i in range(len(self.sessions)):
            self.attach(i, retry=False)

    def _same_range(self, i: int, reply: pb.JoinResponse) -> None:
        s = self.sessions[i]
        if served_range(s.address, i, len(self.sessions), reply, self.manifest) != self.ranges[i]:
            raise ConfigError(
                f"The server at {s.address} came back holding another range of the model."
            )

    def rejoin_lost(self, settle: Callable[[], None], reopened: Callable[[], None]) -> None:
        """Join every lost session again, once ``settle()`` has ended the pushes in flight;
        ``reopened()`` after each round. After a shard restarted, bring every shard back to
        one round: also after a restart that a join found with no session lost (a worker
        starting, whose two joins of a shard met two incarnations: its clocks there are the
        restarted cut's and the other shards' rounds, which empty pushes must not bridge)."""
        while True:
            lost = [i for i, s in enumerate(self.sessions) if s.lost]
            if lost:
                settle()
                for i in lost:
                    self.attach(i, retry=True)
                reopened()  # into the new buffers
            restarted = [s for s in self.sessions if s.restarted]
            for s in restarted:
                s.restarted = False
            if restarted and len(self.sessions) > 1:
                rewind_ahead(self.sessions)  # the shards ahead: lost, joined next round
            elif not lost:
                return
