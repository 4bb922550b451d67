"""The server's side of the payload channels (``transport/channels.py``): a push's gradient
and a pull's weights go through the worker's shared segment when the server took it at
Join, else through the gRPC stream. The one place the server picks.

Either way a push's gradient lands in a buffer of the server's (reused afterwards) before
anything looks at it: the checks and the optimizer read the same bytes, which the worker
cannot change meanwhile."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression, wire
from paramserver.errors import InvalidRequest
from paramserver.server.engine.checks import Scan
from paramserver.transport.attachments import Attachments

# Receive buffers kept for reuse: a fresh 64 MiB buffer costs about 7 ms of page faults.
KEEP_BUFFERS = 4


class Loan:
    """A receive buffer of the pool (``Payloads.lent``); ``bytes``: its first bytes."""

    def __init__(self, payloads: Payloads, buf: np.ndarray, nbytes: int):
        self._payloads, self._buf = payloads, buf
        self.bytes = buf.view(np.uint8)[:nbytes]
        self.kept = self._given = False

    def keep(self) -> Callable[[], None]:
        """Keep the buffer past the block: the caller gives it back with what this returns."""
        self.kept = True
        return self.give

    def give(self) -> None:
        if not self._given:
            self._given = True
            self._payloads._give(self._buf)


class Payloads:
    """Where the payloads of each worker travel."""

    def __init__(self, shared: Attachments, dtype: np.dtype | None = None):
        self.shared = shared
        # the flat buffer's, which a gradient is widened to
        self.dtype = np.dtype(np.float32) if dtype is None else dtype
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []

    @contextmanager
    def gradient(
        self,
        h: pb.PushHeader,
        rest: Iterator[pb.PushChunk],
        received: np.ndarray | None = None,
        finite: bool | None = None,
    ) -> Iterator[tuple[np.ndarray | None, bool | None]]:
        """The push's gradient while the block runs (None if empty), copied from the
        worker's segment or the stream into a receive buffer (reused afterwards), or the
        bytes ``received`` already (the data port's, in a buffer of ``received_buffer``,
        ``finite`` as found while they arrived); and whether it is finite where that was
        found while it was copied (else None).

        Raises:
            BrokenSegment: the worker's segment changed size or cannot be read.
        """
        flat = self.dtype.name
        numel = self.shared.total_bytes // self.dtype.itemsize
        if h.empty:
            wire.expect_end(rest)
            yield None, None
        elif h.shm:
            wire.expect_end(rest, "A push through shared memory")
            scan = Scan(self.dtype)
            with self._buffer(self.shared.total_bytes) as buf:
                yield self.shared.gradient(h.worker_id, h.shm_slot, buf, scan), scan.finite
        elif received is not None:
            wire.expect_end(rest, "A push received whole")
            own = not h.topk and compression.wire_dtype(h.dtype) == flat  # not widened
            with self._decoded(h, received, numel) as grad:
                yield grad, finite if own else None
        elif h.topk or compression.wire_dtype(h.dtype) != flat:
            with self.received_buffer(h.total_bytes) as raw:
                wire.decode_payload(rest, wire.Assembler(h.total_bytes, raw))
                with self._decoded(h, raw, numel) as grad:
                    yield grad, None
        else:
            with self._buffer(h.total_bytes) as buf:
                yield wire.decode_payload(rest, wire.Assembler(h.total_bytes, buf)), None

    @contextmanager
    def _decoded(self, h: pb.PushHeader, raw: np.ndarray, numel: int) -> Iterator[np.ndarray]:
        """The push's bytes ``raw`` as the flat buffer's ``numel`` elements while the block
        runs: themselves when they are that already, else widened (16 bits) or scattered
        (top-k) into a receive buffer of the server's."""
        flat = self.dtype.name
        if not h.topk and compression.wire_dtype(h.dtype) == flat:
            yield compression.to_float32(raw, h.dtype, h.exact, flat)
            return
        with self._buffer(numel * self.dtype.itemsize) as out:
            if h.topk:
                yield compression.sparse_to_dense(raw, h.topk, h.dtype, h.exact, numel, flat, out)
            else:
                yield compression.to_float32(raw, h.dtype, h.exact, flat, out)

    @contextmanager
    def received_buffer(self, nbytes: int) -> Iterator[np.ndarray]:
        """``nbytes`` bytes to receive a payload into while the block runs, kept for reuse."""
        with self.lent(nbytes) as loan:
            yield loan.bytes

    @contextmanager
    def lent(self, nbytes: int) -> Iterator[Loan]:
        """``nbytes`` bytes to receive a payload into, given back after the block unless
        the loan was ``kept`` (then by what ``kept`` returned)."""
        loan = Loan(self, self._take(-(-nbytes // self.dtype.itemsize)), nbytes)
        try:
            yield loan
        finally:
            if not loan.kept:
                loan.give()

    @contextmanager
    def _buffer(self, nbytes: int) -> Iterator[np.ndarray]:
        """A receive buffer of ``nbytes`` while the block runs, kept for reuse after."""
        buf = self._take(-(-nbytes // self.dtype.itemsize))
        try:
            yield buf
        finally:
            self._give(buf)

    def _take(self, numel: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.size == numel:
                    return self._free.pop(i)
        return np.empty(numel, self.dtype)

    def _give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < KEEP_BUFFERS:
                self._free.append(buf)

    def destination(self, request: pb.PullRequest) -> Callable[[np.ndarray], None] | None:
        """Where the pull's weights go: a sink that writes them into the worker's segment
        (the coordinator calls it under its lock, one copy), or None (a snapshot, streamed).

        Raises (before the pull waits or takes a batch):
            InvalidRequest: a pull through shared memory from a worker without a segment;
                a streamed one in an unknown dtype, or int8.
            BrokenSegment: the worker's segment changed size.
        """
        if not request.shm:
            self._sent_as(request)
            return None
        self.shared.check(request.worker_id)
        return partial(self.shared.put_weights, request.worker_id)

    def check_pull(self, request: pb.PullRequest, numel: int) -> None:
        """What ``destination`` and ``weights`` would refuse of a pull of ``numel`` weights,
        checked before its step does anything (a push-pull's push is applied only when its
        pull can be answered).

        Raises:
            InvalidRequest: a streamed pull in an unknown dtype or int8, or with an exact
                tail longer than the weights.
        """
        if request.shm:
            return
        codec = self._sent_as(request)
        if not codec.raw and not 0 <= request.exact <= numel:
            raise InvalidRequest(f"A pull asks for {request.exact} exact elements of {numel}.")

    def _sent_as(self, request: pb.PullRequest) -> type[compression.Codec]:
        """The codec of the weights a streamed pull asks for.

        Raises:
            InvalidRequest: an unknown dtype, or int8 (pulls come in 16 bits).
        """
        codec = compression.by_dtype(request.dtype or self.dtype.name)
        if codec.block:
            raise InvalidRequest(
                f"Weights are not sent in {codec.dtype}; ask for bfloat16 (as --compress "
                f"{codec.name} does)."
            )
        return codec

    def weights(
        self, request: pb.PullRequest, header: pb.PullHeader, weights: np.ndarray
    ) -> memoryview:
        """The bytes to send after ``header``: none when the weights are in the worker's
        segment already (``header.shm`` says so); a rounded copy in the 16-bit dtype the
        request asks for (its last ``exact`` elements as they are); else the weights.

        Raises:
            InvalidRequest: an unknown dtype or int8, or an exact tail longer than the
                weights.
        """
        if request.shm:
            header.shm = True
            return memoryview(b"")
        codec = self._sent_as(request)
        if codec.raw:
            return compression.as_bytes(weights)
        if not 0 <= request.exact <= weights.size:
            raise InvalidRequest(
                f"A pull asks for {request.exact} exact elements of {weights.size}."
            )
        header.dtype, header.exact = codec.dtype, request.exact
        encoder = codec(weights.size, request.exact, self.dtype.name)
        with warnings.catch_warnings():  # the snapshot is read-only; it is only read
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(weights)
        return encoder.encode(source)
