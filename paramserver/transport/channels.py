"""How one shard's payloads move: the PayloadChannel, and the one place that picks it.

A channel carries the payloads of one server (shard) for one session: the gradient of a push
from a staging slot, and the weights of a pull into a receive buffer, both views (float32, or float64) of
the shard's range of the model's flat buffer. Control (the headers) always goes over gRPC.
A session's ``GrpcChannel`` (``client.py``) holds one, opened after each Join.

- ``GrpcStreamChannel``: payloads stream in chunks (``codec.wire``), gradients optionally
  compressed (``codec.compression``): for any server, on any host.
- ``ShmChannel`` (``shm_channel.py``): payloads go through the worker's shared-memory segment that the server
  mapped at Join (``paramserver.transport.shm``); a push and the next pull are one PushPull, carried
  by the server's same-host control socket when it offered one (``ControlSocket``), else by
  a gRPC call. A control socket that fails (the server died, a deadline passed) is dropped
  and that session's steps go over gRPC, whose retries and rejoins take over.

``client.open_channel`` chooses among them and the data port's ``TcpChannel`` (``tcp.py``).
"""

from __future__ import annotations

import abc
import logging
import socket
import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression, records, wire
from paramserver.codec import rows as sparse_wire
from paramserver.errors import InvalidRequest, from_rpc_error
from paramserver.transport import pinned
from paramserver.transport import shm as shmem
from paramserver.transport.stub import Stub

log = logging.getLogger(__name__)


class PayloadChannel(abc.ABC):
    """Push, pull and push-and-pull for one shard's range.

    ``weights`` receives pulled weights; ``slots[i]`` holds the gradient of a push staged in
    slot i. Calls raise ``grpc.RpcError`` (the session retries and translates them).
    """

    shm: bool
    weights: torch.Tensor
    slots: list[torch.Tensor]

    @abc.abstractmethod
    def push(self, header: pb.PushHeader, slot: int, timeout: float) -> pb.PushResponse:
        """Send the gradient in ``slots[slot]`` (none if ``header.empty``)."""

    @abc.abstractmethod
    def pull(self, request: pb.PullRequest, timeout: float) -> pb.PullHeader:
        """Receive the weights the request asks for into ``weights``."""

    @abc.abstractmethod
    def push_pull(
        self, header: pb.PushHeader, slot: int, request: pb.PullRequest, timeout: float
    ) -> pb.PullHeader:
        """``push``, then ``pull``: one round trip where the channel can."""

    @property
    @abc.abstractmethod
    def description(self) -> str:
        """How the payloads and the steps travel, for the log."""

    @property
    def page_locked(self) -> bool:
        """Whether the buffers the payloads are copied to and from are page-locked (a CUDA
        worker's: ``pinned.py``)."""
        return bool(self.weights.is_pinned())

    def close(self) -> None:  # noqa: B027 - only a shared segment has anything to release
        """Release what the channel holds (a shared segment)."""

    @property
    def takes_pieces(self) -> bool:
        """Whether ``stage`` may take pieces: only the data port sends from the gradients."""
        return False

    def stage(self, slot: int, pieces: list[torch.Tensor] | None) -> bool:
        """See ``Channel.stage``: this channel sends from its slots."""
        return False

    def row_messages(
        self, parts: Sequence[sparse_wire.RowGradients], slot: int
    ) -> list[pb.RowGradients]:
        """See ``Channel.row_messages``: here, the values in the messages."""
        return [sparse_wire.gradients_to_proto(p) for p in parts]


class GrpcStreamChannel(PayloadChannel):
    """Payloads as gRPC streams of chunks; gradients in ``codec``'s wire dtype."""

    shm = False

    def __init__(
        self,
        stub: Stub,
        weights: torch.Tensor,
        slots: list[torch.Tensor],
        codec: compression.Codec,
        chunk_bytes: int,
    ):
        self.stub = stub
        self.weights = weights
        self.slots = slots
        self.codec = codec
        self.chunk_bytes = chunk_bytes

    @property
    def description(self) -> str:
        return f"streamed over gRPC (gradients in {self.codec.dtype})"

    def push(self, header: pb.PushHeader, slot: int, timeout: float) -> pb.PushResponse:
        payload = memoryview(b"")
        if not header.empty:
            payload = encode(self.codec, header, self.slots[slot], slot)
        header, rows = sparse_wire.split_rows(header)
        response: pb.PushResponse = self.stub.Push(
            wire.encode_push(header, payload, self.chunk_bytes, rows), timeout=timeout
        )
        return response

    def pull(self, request: pb.PullRequest, timeout: float) -> pb.PullHeader:
        ask_for(request, self.codec)
        out = np.frombuffer(self.codec.receive_buffer(self.weights), np.uint8)
        header, _ = wire.decode_pull(self.stub.Pull(request, timeout=timeout), out, out.nbytes)
        received(header, self.codec, self.weights)
        return header

    def push_pull(
        self, header: pb.PushHeader, slot: int, request: pb.PullRequest, timeout: float
    ) -> pb.PullHeader:
        # A retry after a lost reply pushes again: the server acknowledges it as a duplicate.
        self.push(header, slot, timeout)
        return self.pull(request, timeout)


def encode(
    codec: compression.Codec, header: pb.PushHeader, gradient: torch.Tensor, slot: int
) -> memoryview:
    """The push's payload, its form said in ``header`` (a retry of the push, the same
    slot and iteration, encodes the same: top-k's and int8's residual moves once)."""
    payload = codec.encode(gradient, key=(slot, header.iteration))
    header.dtype, header.exact, header.topk = codec.dtype, codec.exact, codec.topk
    header.scale_block = codec.block
    header.total_bytes = payload.nbytes
    return payload


def ask_for(request: pb.PullRequest, codec: compression.Codec) -> None:
    """Ask for the weights in ``codec``'s pulls' wire form (16 bits with --compress)."""
    codec = codec.pulls
    if not codec.raw:
        request.dtype, request.exact = codec.dtype, codec.exact


def received(header: pb.PullHeader, codec: compression.Codec, weights: torch.Tensor) -> None:
    """The weights a pull received in ``codec``'s receive buffer, widened into ``weights``.

    Raises:
        InvalidRequest: the server answered in another form than asked.
    """
    codec = codec.pulls
    asked = ("", 0) if codec.raw else (codec.dtype, codec.exact)
    if (header.dtype, header.exact) != asked:
        raise InvalidRequest(
            f"The server sent weights as {header.dtype or 'its own type'} with "
            f"{header.exact} exact elements; {asked[0] or 'its own type'} was asked."
        )
    codec.decode_into(weights)


class ControlSocket:
    """The worker's end of a server's same-host control socket (``server/doors/doorbell.py``):
    one PushPull a frame (``codec/records.py``), answered or failed as a gRPC call is."""

    MARGIN = 5.0  # seconds past the call's deadline before the server is deemed stuck
    RETRY = 0.01  # seconds between connects while the server's backlog is full

    def __init__(self, name: str, worker_id: str, nonce: bytes, timeout: float):
        self.busy = threading.Lock()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout)
            self._connect(name, time.monotonic() + timeout)
            try:
                records.send(self.sock, records.Frame(nonce + worker_id.encode()))
            except (BrokenPipeError, ConnectionResetError) as exc:
                # refused at once (another user, too many pending): its reply says why
                log.debug("the control socket closed before the hello: %s", exc)
            self._reply()
        except BaseException:
            self.sock.close()
            raise

    def _connect(self, name: str, deadline: float) -> None:
        """Connect; a full backlog (a connect with a timeout fails at once) is retried until
        ``deadline``, as the server's accept thread drains it."""
        while True:
            try:
                return self.sock.connect("\0" + name)
            except BlockingIOError:
                if time.monotonic() + self.RETRY > deadline:
                    raise
                time.sleep(self.RETRY)

    def _reply(self) -> bytes:
        frame = records.recv(self.sock)
        if frame is None:
            raise ConnectionError("the server closed its control socket")
        return records.raise_for(frame)

    def push_pull(self, request: pb.PushPullRequest, timeout: float) -> pb.PushPullResponse:
        self.sock.settimeout(timeout + self.MARGIN)
        records.send(self.sock, records.Frame(request.SerializeToString(), seconds=timeout))
        return pb.PushPullResponse.FromString(self._reply())

    def close(self) -> None:
        self.sock.close()


def open_control(name: str, worker_id: str, nonce: bytes, timeout: float) -> ControlSocket | None:
    """A connection to the control socket ``name``, or None (logged): steps go over gRPC."""
    if not name:
        return None
    try:
        return ControlSocket(name, worker_id, nonce, timeout)
    except (OSError, grpc.RpcError) as exc:
        log.warning("cannot use the server's control socket (%s); steps go over gRPC", exc)
        return None


class StreamBuffers:
    """Where streamed payloads land: one flat receive buffer and one flat buffer per push
    slot for the whole model (page-locked for CUDA models: ``pinned.empty``), made on first
    use; each streaming channel (gRPC streams, the data port) gets views of its range."""

    def __init__(
        self, numel: int, slots: int, device: torch.device, dtype: torch.dtype = torch.float32
    ):
        self.numel, self.nslots, self.dtype = numel, slots, dtype
        self.pinned = device.type == "cuda"
        self._buffers: list[torch.Tensor] = []

    def views(self, lo: int, hi: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The receive buffer's and every slot's elements [lo, hi)."""
        if not self._buffers:
            self._buffers = [
                pinned.empty(self.numel, self.dtype, self.pinned, "the streamed payloads' buffer")
                for _ in range(1 + self.nslots)
            ]
        return self._buffers[0][lo:hi], [b[lo:hi] for b in self._buffers[1:]]


def new_segment(
    nbytes: int, slots: int, dtype: str = "float32", rows_bytes: int = shmem.ROWS_BYTES
) -> shmem.Segment | None:
    """A fresh shared segment to offer a server (with rows parts of ``rows_bytes``), or None
    (logged) if none can be made."""
    try:
        return shmem.Segment(nbytes, slots, dtype, rows_bytes=rows_bytes)
    except OSError as exc:
        log.warning("cannot create a shared-memory segment (%s); streaming over gRPC", exc)
        return None


def observe(
    channel: grpc.Channel, total_bytes: int, timeout: float = 60.0, itemsize: int = 4
) -> tuple[pb.PullHeader, np.ndarray]:
    """The server's current weights without joining the run (for evaluation and checkpoints)."""
    try:
        return wire.decode_pull(
            Stub(channel).Pull(pb.PullRequest(), timeout=timeout), None, total_bytes, itemsize
        )
    except grpc.RpcError as err:
        raise from_rpc_error(err, "observer pull") from None
