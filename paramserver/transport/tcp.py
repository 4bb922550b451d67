"""The worker's end of a server's data port (``server/doors/dataport.py``): each step one frame
(``codec/records.py``), the gradient's raw bytes sent from the codec's buffer and the
weights' raw bytes read straight into the receive buffer, on one TCP connection per shard.

``connect`` opens it after a Join that offered a port: TLS when the worker's security has
it (the server's certificate checked against ``--tls-ca`` and the host name dialled, the
worker's certificate presented), then the hello with the token and the Join's nonce. A
connection that fails, then or later (the server went, a deadline passed), is dropped and
that session's steps go over gRPC streams (``fallback``), whose retries and rejoins take
over; the next Join opens the port again.
"""

from __future__ import annotations

import logging
import socket
import threading

import grpc
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import records
from paramserver.config import Security
from paramserver.transport.channels import (
    GrpcStreamChannel,
    PayloadChannel,
    ask_for,
    encode,
    received,
)
from paramserver.transport.security import client_ssl_context

log = logging.getLogger(__name__)

MARGIN = 5.0  # seconds past a call's deadline before the server is deemed stuck
# The most a connect and its hello may take: a port a firewall drops costs a Join this
# long before the steps go over gRPC.
CONNECT_SECONDS = 5.0


# A connection whose peer stops answering (a link down, a host gone) is found dead after
# KEEPALIVE_IDLE s of silence and KEEPALIVE_COUNT unanswered probes KEEPALIVE_INTERVAL s
# apart: a step blocked on it fails (and goes over gRPC) instead of waiting for its deadline.
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 20, 5, 3


def tune(sock: socket.socket) -> None:
    """No Nagle delay on the small frames; keepalive probes on a quiet connection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
    ):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


# Pieces smaller than this are copied into the slot and sent with their neighbours: one
# send a run of small tensors instead of one each.
SMALL_PIECE = 256 << 10


def segments(pieces: list[torch.Tensor], slot: torch.Tensor) -> list[memoryview]:
    """The bytes of ``pieces``, in order, as few buffers: each large piece as itself (no
    copy), each run of small ones copied into ``slot`` at their place."""
    out: list[memoryview] = []
    at, run = 0, -1  # where the next piece goes in the slot; where a run of small ones began
    for p in pieces:
        n = p.numel()
        if p.nbytes < SMALL_PIECE:
            slot[at : at + n].copy_(p)
            run = at if run < 0 else run
        else:
            if run >= 0:
                out.append(slot[run:at].numpy().data.cast("B"))
                run = -1
            out.append(p.numpy().data.cast("B"))
        at += n
    if run >= 0:
        out.append(slot[run:at].numpy().data.cast("B"))
    return out


def host_of(address: str) -> str:
    """The host of ``host:port`` (an IPv6 one without its brackets)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


class DataSocket:
    """An authenticated connection to a data port: one step at a time."""

    def __init__(
        self,
        host: str,
        port: int,
        security: Security,
        worker_id: str,
        nonce: bytes,
        timeout: float,
    ):
        self.busy = threading.Lock()
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            tune(sock)
            tls = client_ssl_context(security)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=host)
            records.send(sock, records.Frame(records.data_hello(security.token, nonce, worker_id)))
            self._reply(sock)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    @staticmethod
    def _reply(sock: socket.socket) -> records.Frame:
        frame = records.recv(sock)
        if frame is None:
            raise ConnectionError("the server closed its data port")
        records.raise_for(frame)
        return frame

    def step(
        self, request: pb.PushPullRequest, gradient: records.Bulk, timeout: float
    ) -> tuple[pb.PushPullResponse, records.Frame]:
        """Send one step (and the gradient's bytes); its answer and frame, whose bulk (the
        weights' bytes) the caller reads next with ``weights``."""
        self.sock.settimeout(timeout + MARGIN)
        bulk = records.bulk_bytes(gradient)
        frame = records.Frame(request.SerializeToString(), seconds=timeout, bulk=bulk)
        records.send(self.sock, frame, gradient)
        answer = self._reply(self.sock)
        return pb.PushPullResponse.FromString(answer.payload), answer

    def weights(self, frame: records.Frame, view: memoryview) -> None:
        """Read the weights' bytes ``frame`` announced into ``view``.

        Raises:
            ConnectionError: the server announced another size (the connection is lost).
        """
        if frame.bulk != view.nbytes:
            raise ConnectionError(
                f"the server sent {frame.bulk} bytes of weights for a buffer of {view.nbytes}"
            )
        records.recv_bulk(self.sock, view)

    def close(self) -> None:
        self.sock.close()


def connect(
    address: str,
    reply: pb.JoinResponse,
    security: Security,
    timeout: float,
) -> DataSocket | None:
    """A connection to the data port ``reply`` offers on ``address``'s host, or None
    (logged): the steps stream over gRPC."""
    if not reply.data_port:
        return None
    host = host_of(address)
    try:
        return DataSocket(
            host,
            reply.data_port,
            security,
            reply.worker_id,
            reply.data_nonce,
            min(timeout, CONNECT_SECONDS),
        )
    except (OSError, grpc.RpcError) as exc:
        log.warning(
            "cannot use the server's data port %s:%d (%s); payloads stream over gRPC",
            host,
            reply.data_port,
            exc,
        )
        return None


class TcpChannel(PayloadChannel):
    """Payloads as raw bytes on a data port; what it cannot carry (a request over a frame's
    ``MAX_PAYLOAD``: a push with many table rows; a second call at once) and everything
    after it failed goes over ``fallback``."""

    shm = False

    def __init__(self, data: DataSocket, fallback: GrpcStreamChannel):
        self.data: DataSocket | None = data
        self.fallback = fallback
        self.weights, self.slots = fallback.weights, fallback.slots
        self.codec = fallback.codec
        self._pieces: dict[int, list[torch.Tensor]] = {}  # a slot's push, sent from these

    @property
    def takes_pieces(self) -> bool:
        """The gradients go as they are (the flat buffer's own elements, no top-k)."""
        return self.data is not None and self.codec.raw and not self.codec.topk

    def stage(self, slot: int, pieces: list[torch.Tensor] | None) -> bool:
        """Send the push of ``slot`` from ``pieces`` (no copy into the slot) while the data
        port carries it; a fallback to gRPC copies them into the slot first."""
        if pieces is None or not self.takes_pieces:
            self._pieces.pop(slot, None)
            return False
        self._pieces[slot] = pieces
        return True

    def _in_slot(self, slot: int) -> None:
        """The push of ``slot`` as the slot's bytes, for a path that sends from the slot."""
        pieces = self._pieces.pop(slot, None)
        if pieces is not None:
            torch.cat(pieces, out=self.slots[slot])

    @property
    def description(self) -> str:
        if self.data is None:
            return self.fallback.description + " (the data port failed)"
        return f"over the data port (gradients in {self.codec.dtype})"

    def _step(
        self, request: pb.PushPullRequest, gradient: records.Bulk, timeout: float
    ) -> pb.PushPullResponse | None:
        """The step on the data port, or None where it must go over gRPC instead."""
        data = self.data
        if data is None or request.ByteSize() > records.MAX_PAYLOAD:
            return None
        if not data.busy.acquire(blocking=False):
            return None
        try:
            if request.HasField("pull"):
                ask_for(request.pull, self.codec)
            answer, frame = data.step(request, gradient, timeout)
            if request.HasField("pull"):
                data.weights(frame, self.codec.receive_buffer(self.weights))
                received(answer.pull, self.codec, self.weights)
            return answer
        except OSError as exc:  # EOF, reset, timeout: the server is gone or stuck
            log.warning("the data port failed (%s); payloads stream over gRPC", exc)
            data.close()
            self.data = None
            return None
        finally:
            data.busy.release()

    def _push_part(self, header: pb.PushHeader, slot: int) -> records.Bulk:
        """Fill ``header`` for the data port; the gradient's bytes (None if empty)."""
        if header.empty:
            header.total_bytes = 0
            return None
        pieces = self._pieces.get(slot)
        if pieces is None:
            return encode(self.codec, header, self.slots[slot], slot)
        header.dtype, header.exact, header.topk = self.codec.dtype, 0, 0
        header.total_bytes = sum(p.nbytes for p in pieces)
        return segments(pieces, self.slots[slot])

    def push(self, header: pb.PushHeader, slot: int, timeout: float) -> pb.PushResponse:
        payload = self._push_part(header, slot)
        answer = self._step(pb.PushPullRequest(push=header), payload, timeout)
        if answer is not None:
            self._pieces.pop(slot, None)  # answered: the gradients may go
            return answer.push
        self._in_slot(slot)
        return self.fallback.push(header, slot, timeout)

    def pull(self, request: pb.PullRequest, timeout: float) -> pb.PullHeader:
        answer = self._step(pb.PushPullRequest(pull=request), None, timeout)
        if answer is not None:
            return answer.pull
        return self.fallback.pull(request, timeout)

    def push_pull(
        self, header: pb.PushHeader, slot: int, request: pb.PullRequest, timeout: float
    ) -> pb.PullHeader:
        payload = self._push_part(header, slot)
        answer = self._step(pb.PushPullRequest(push=header, pull=request), payload, timeout)
        if answer is not None:
            self._pieces.pop(slot, None)  # answered: the gradients may go
            return answer.pull
        # A retry after a lost reply pushes again: the server acknowledges it as a duplicate.
        self._in_slot(slot)
        return self.fallback.push_pull(header, slot, request, timeout)

    def close(self) -> None:
        if self.data is not None:
            self.data.close()
