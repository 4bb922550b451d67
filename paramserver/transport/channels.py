"""How one shard's payloads move: the PayloadChannel, and the one place that picks it.

A channel carries the payloads of one server (shard) for one session: the gradient of a push
from a staging slot, and the weights of a pull into a receive buffer, both views (float32, or float64) of
the shard's range of the model's flat buffer. Control (the headers) always goes over gRPC.
A session's ``GrpcChannel`` (``client.py``) holds one, opened after each Join.

- ``GrpcStreamChannel``: payloads stream in chunks (``codec.wire``), gradients optionally
  compressed (``codec.compression``): for any server, on any host.
- ``ShmChannel``: payloads go through the worker's shared-memory segment that the server
  mapped at Join (``paramserver.transport.shm``); a push and the next pull are one PushPull, carried
  by the server's same-host control socket when it offered one (``ControlSocket``), else by
  a gRPC call. A control socket that fails (the server died, a deadline passed) is dropped
  and that session's steps go over gRPC, whose retries and rejoins take over.

``client.open_channel`` chooses among them and the data port's ``TcpChannel`` (``tcp.py``).
"""

from __future__ import annotations

import abc
import logging
import secrets
import socket
import threading
import time

import grpc
import numpy as np
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression, records, wire
from paramserver.codec import rows as sparse_wire
from paramserver.errors import InvalidRequest, from_rpc_error
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

    def close(self) -> None:  # noqa: B027 - only a shared segment has anything to release
        """Release what the channel holds (a shared segment)."""

    @property
    def takes_pieces(self) -> bool:
        """Whether ``stage`` may take pieces: only the data port sends from the gradients."""
        return False

    def stage(self, slot: int, pieces: list[torch.Tensor] | None) -> bool:
        """See ``Channel.stage``: this channel sends from its slots."""
        return False


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
    slot and iteration, encodes the same: top-k's residual moves once)."""
    payload = codec.encode(gradient, key=(slot, header.iteration))
    header.dtype, header.exact, header.topk = codec.dtype, codec.exact, codec.topk
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
    """The worker's end of a server's same-host control socket (``server/doorbell.py``):
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


class ShmChannel(PayloadChannel):
    """Payloads in the worker's segment, mapped by the server: headers alone on the wire,
    through the control socket if there is one."""

    shm = True

    def __init__(
        self,
        stub: Stub,
        segment: shmem.Segment,
        control: ControlSocket | None = None,
        codec: compression.Codec | None = None,
    ):
        self.stub = stub
        self.segment = segment
        self.control = control
        # with --compress: gradients and weights rounded in place, as the wire would
        self.codec = codec
        self.weights = torch.from_numpy(segment.weights)
        self.slots = [torch.from_numpy(a) for a in segment.slots]
        self._rows_pull = threading.Lock()  # one row pull at a time uses the pulls' part

    @property
    def description(self) -> str:
        via = "the control socket" if self.control is not None else "gRPC"
        return f"in shared memory, steps over {via}"

    def pull_rows(
        self, stub: Stub, request: pb.RowsRequest, timeout: float | None
    ) -> pb.RowsResponse:
        """A row pull whose values the server may write into the segment's rows part for
        pulls (``RowsResponse.shm``): they are copied out into the reply's ``values`` and
        ``more``, as if they had come in it. Values whose stamp is not this pull's (a late
        writer of an earlier pull that timed out, or a segment this session left after a
        rejoin) are not used: the pull is made again with the values in the reply."""
        rows = self.segment.rows
        if not rows:
            reply: pb.RowsResponse = stub.PullRows(request, timeout=timeout)
            return reply
        stamp = secrets.randbits(63) | 1
        request.shm, request.shm_stamp = True, stamp
        with self._rows_pull:
            reply = stub.PullRows(request, timeout=timeout)
            if not reply.shm:
                return reply
            values = _stamped(rows[0], stamp, list(reply.shm_sizes))
        if values is None or len(values) != 1 + len(reply.more):
            log.info("a row pull's values in shared memory were not its own; pulling again")
            request.shm, request.shm_stamp = False, 0
            again: pb.RowsResponse = stub.PullRows(request, timeout=timeout)
            return again
        reply.values = values[0]
        for i, v in enumerate(values[1:]):
            reply.more[i] = v
        reply.shm = False
        del reply.shm_sizes[:]
        return reply

    def _rows_into_segment(self, header: pb.PushHeader, slot: int) -> pb.PushHeader:
        """The header to send: a copy whose rows' values are in slot ``slot``'s rows part
        (``RowGradients.shm``), so it is small and the control socket carries it; or
        ``header`` itself when they do not all fit there, or their ids alone pass a header's
        rows (row chunks carry them then, values and all). ``header`` is not changed: a
        retry hands it again, and it is moved again from offset 0, the same bytes."""
        rows = self.segment.rows
        if not header.rows or not rows or any(m.shm for m in header.rows):
            return header
        ids = sum(len(m.ids) for m in header.rows) + 64 * len(header.rows)
        offsets, at = [], 0
        for msg in header.rows:
            offsets.append(at)
            at = -(-(at + len(msg.values)) // 64) * 64
        part = rows[1 + slot]
        if ids > sparse_wire.ROWS_IN_HEADER or offsets[-1] + len(header.rows[-1].values) > len(
            part
        ):
            return header
        out = pb.PushHeader()
        out.CopyFrom(header)
        for msg, offset in zip(out.rows, offsets, strict=True):
            part[offset : offset + len(msg.values)] = np.frombuffer(msg.values, np.uint8)
            msg.shm, msg.shm_offset, msg.values = True, offset, b""
        return out

    def _push_pull(self, request: pb.PushPullRequest, timeout: float) -> pb.PushPullResponse:
        control = self.control
        # One call at a time on the socket; another at the same moment goes over gRPC, and
        # so does a request larger than a frame (a push with many table rows).
        fits = control is not None and request.ByteSize() <= records.MAX_PAYLOAD
        if control is not None and fits and control.busy.acquire(blocking=False):
            try:
                return control.push_pull(request, timeout)
            except OSError as exc:  # EOF, reset, timeout: the server is gone or stuck
                log.warning("the control socket failed (%s); steps go over gRPC", exc)
                control.close()
                self.control = None
            finally:
                control.busy.release()
        reply: pb.PushPullResponse = self.stub.PushPull(request, timeout=timeout)
        return reply

    def _rounded(self, slot: int | None, iteration: int = 0) -> None:
        """Round a gradient about to be pushed (``slot``; top-k: sparsified), or the weights
        just pulled, as the wire would."""
        if self.codec is None:
            return
        if slot is None:
            self.codec.pulls.round_(self.weights)
        else:
            self.codec.round_(self.slots[slot], key=(slot, iteration))

    def push(self, header: pb.PushHeader, slot: int, timeout: float) -> pb.PushResponse:
        header.shm, header.shm_slot = True, slot
        if not header.empty:
            self._rounded(slot, header.iteration)
            header = self._rows_into_segment(header, slot)
        sent, rows = sparse_wire.split_rows(header)
        if rows:
            return self._push_stream(sent, rows, timeout)
        return self._push_pull(pb.PushPullRequest(push=header), timeout).push

    def _push_stream(
        self, header: pb.PushHeader, rows: list[pb.RowGradients], timeout: float
    ) -> pb.PushResponse:
        """A push whose rows are too many for one message: a Push stream carries them after
        the header (the gradient is in the segment)."""
        response: pb.PushResponse = self.stub.Push(
            wire.encode_push(header, memoryview(b""), wire.DEFAULT_CHUNK_BYTES, rows),
            timeout=timeout,
        )
        return response

    def pull(self, request: pb.PullRequest, timeout: float) -> pb.PullHeader:
        request.shm = True  # a pull alone: on the control socket too, when it is free
        header = self._push_pull(pb.PushPullRequest(pull=request), timeout).pull
        self._rounded(None)
        return header

    def push_pull(
        self, header: pb.PushHeader, slot: int, request: pb.PullRequest, timeout: float
    ) -> pb.PullHeader:
        header.shm, header.shm_slot, request.shm = True, slot, True
        if not header.empty:
            self._rounded(slot, header.iteration)
            header = self._rows_into_segment(header, slot)
        sent, rows = sparse_wire.split_rows(header)
        if rows:
            self._push_stream(sent, rows, timeout)
            return self.pull(request, timeout)
        pulled = self._push_pull(pb.PushPullRequest(push=header, pull=request), timeout).pull
        self._rounded(None)
        return pulled

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        self.segment.close()


class StreamBuffers:
    """Where streamed payloads land: one flat receive buffer and one flat buffer per push
    slot for the whole model (pinned for CUDA models), made on first use; each streaming
    channel gets views of its range."""

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
                torch.empty(self.numel, dtype=self.dtype, pin_memory=self.pinned)
                for _ in range(1 + self.nslots)
            ]
        return self._buffers[0][lo:hi], [b[lo:hi] for b in self._buffers[1:]]


def _stamped(part: np.ndarray, stamp: int, sizes: list[int]) -> list[bytes] | None:
    """The values of ``sizes`` bytes each after the pulls' part's stamp, if the stamp is
    ``stamp`` before and after they are copied (None otherwise, or if they do not fit)."""
    if any(n < 0 for n in sizes) or shmem.ROWS_STAMP + sum(sizes) > len(part):
        return None
    mark = stamp.to_bytes(8, "little")
    if part[:8].tobytes() != mark:
        return None
    at, values = shmem.ROWS_STAMP, []
    for n in sizes:
        values.append(part[at : at + n].tobytes())
        at += n
    return values if part[:8].tobytes() == mark else None


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
