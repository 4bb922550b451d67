"""The data port: how workers on other hosts push and pull, on a TCP socket of its own
beside the gRPC port, at the link's speed.

gRPC Python streams carry about 0.4x what a plain Python socket does on loopback (``bench
transport``), and at 10 Gbit/s they are what caps a worker (``bench network``): each 4 MiB
chunk is a protobuf message copied into and out of gRPC's buffers. Here a step is one frame
(``codec/records.py``): a ``PushPullRequest``, then the gradient's raw bytes, read straight
into a buffer of the server's (checked in size against the request before a byte is
read); the answer is a ``PushPullResponse``, then the weights' raw bytes, sent from the
server's snapshot without a copy. Join, heartbeats, leave, status and row pulls stay on
gRPC, and so does whatever the port refuses: a worker whose connection fails goes on over
gRPC streams.

Who may use it is what gRPC admits: a server started with certificates speaks TLS here too
(mutual TLS with a CA: a client without a certificate it signed fails the handshake), and
a hello (``records.data_hello``) carries the server's token, if it has one, and a nonce the
worker's Join answered (over gRPC, so under the same TLS and token), which ties the
connection to that worker. A peer that fails either is refused before it may send a step,
within the bounds every socket door keeps (``listener.py``: 2 s for the handshake and the
hello, at most 16 waiting, one connection a worker).
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression, records
from paramserver.config import Security, ServerConfig
from paramserver.errors import InvalidRequest, Unauthenticated
from paramserver.server.doors.doorbell import parse
from paramserver.server.doors.listener import SEND_SECONDS, Listener, answer_failing
from paramserver.server.doors.payloads import Loan
from paramserver.server.doors.steps import Steps
from paramserver.server.engine.checks import Behind, Scan
from paramserver.transport.security import refusal, server_ssl_context, token_matches
from paramserver.transport.tcp import tune

log = logging.getLogger(__name__)

BULK_MARGIN = 5.0  # seconds past a step's deadline for its bulk to arrive


class DataPort(Listener):
    """Listens on ``host``:``port`` once started (``port`` 0: any free port)."""

    door = "data port"

    def __init__(
        self,
        steps: Steps,
        security: Security,
        host: str,
        port: int,
        observe: Callable[[float], None] = lambda seconds: None,
    ):
        super().__init__()
        self.steps = steps
        self.token = security.token
        self.tls = server_ssl_context(security)
        self.speaks_tls = self.tls is not None
        self.host, self.port = host, port
        self.observe = observe  # each step's time to serve (the metrics' histogram)
        self._nonces: dict[str, bytes] = {}
        self._nonce_lock = threading.Lock()

    def start(self) -> int:
        """Bind and accept in a thread; the port bound, or 0 (logged) where none can bind."""
        return self.port if self.listen() else 0

    def where(self) -> str:
        host = self.host if ":" not in self.host or self.host.startswith("[") else f"[{self.host}]"
        return f" on {host}:{self.port}"

    def _bind(self) -> socket.socket:
        host = "" if self.host in ("0.0.0.0", "::", "[::]") else self.host.strip("[]")
        family = socket.AF_INET6 if ":" in host or self.host in ("::", "[::]") else socket.AF_INET
        listener = socket.create_server(
            (host, self.port), family=family, backlog=64, dualstack_ipv6=family == socket.AF_INET6
        )
        self.port = listener.getsockname()[1]
        return listener

    def issue(self, worker_id: str) -> bytes:
        """A fresh nonce for ``worker_id``'s connection (its Join answers it); the worker's
        earlier nonce is void."""
        nonce = secrets.token_bytes(records.NONCE_BYTES)
        with self._nonce_lock:
            self._nonces[worker_id] = nonce
        return nonce

    def _handshake(self, conn: socket.socket) -> socket.socket:
        tune(conn)  # a worker whose link died is found out, and its thread freed
        if self.tls is None:
            return conn
        return self.tls.wrap_socket(conn, server_side=True)  # raises ssl.SSLError (OSError)

    def _authenticate(self, payload: bytes) -> str:
        """The worker id of a hello that carries the token and the nonce issued to it.

        Raises:
            InvalidRequest: the hello is malformed.
            Unauthenticated: the token or the nonce is wrong.
        """
        token, nonce, worker_id = records.parse_data_hello(payload)
        if not token_matches(self.token, token):
            raise Unauthenticated(refusal(token))
        with self._nonce_lock:
            issued = self._nonces.get(worker_id)
        if issued is None or not secrets.compare_digest(issued, nonce):
            raise Unauthenticated(f"No Join of worker {worker_id!r} issued that nonce; join again.")
        return worker_id

    def _answer(
        self, worker_id: str, frame: records.Frame, conn: socket.socket
    ) -> tuple[records.Frame, memoryview | None]:
        """One step: its request and the gradient's bytes read (or the connection ends), then
        the push and the pull, answered with the weights' bytes."""
        request = parse(frame.payload, worker_id)
        expected = self._bulk(request)
        if frame.bulk != expected:
            raise InvalidRequest(
                f"A step whose request announces {expected} bytes of gradient carries {frame.bulk}."
            )
        # a push of the model's own elements is checked as it arrives, a piece at a time
        flat = self._flat(request)
        scan = Scan(self.steps.payloads.dtype) if flat else None
        with self._received(conn, frame, expected, scan) as loan:
            started = time.perf_counter()
            gradient = None if loan is None else loan.bytes
            finite = None if scan is None or gradient is None else scan.finite
            # a push alone of the model's own elements may be answered before it is
            # applied (ssp:K, async: server/engine/dense_apply.py), its buffer then the apply's
            keep = loan.keep if loan is not None and flat and not request.HasField("pull") else None
            reply, weights = self._step(request, frame, gradient, finite, keep)
            self.observe(time.perf_counter() - started)
        return reply, weights

    def _flat(self, request: pb.PushPullRequest) -> bool:
        """Whether the step pushes the flat buffer's own elements (not 16 bits, not top-k)."""
        push = request.push
        return (
            request.HasField("push")
            and not push.topk
            and compression.wire_dtype(push.dtype) == self.steps.payloads.dtype.name
        )

    def _step(
        self,
        request: pb.PushPullRequest,
        frame: records.Frame,
        gradient: np.ndarray | None,
        finite: bool | None = None,
        keep: Callable[[], Callable[[], None]] | None = None,
    ) -> tuple[records.Frame, memoryview | None]:
        """The push of ``gradient`` (``finite``: as its scan found) and the pull ``request``
        asks for, answered (a failure as its frame: the connection goes on)."""
        try:
            answer, weights = pb.PushPullResponse(), None
            if request.HasField("push"):
                push = self.steps.push(request.push, iter(()), gradient, finite, keep)
                answer.push.CopyFrom(push)
            if request.HasField("pull"):
                remaining = frame.seconds if frame.seconds > 0 else None
                header, weights = self.steps.pull(request.pull, remaining, self._open)
                header.total_bytes = weights.nbytes
                answer.pull.CopyFrom(header)
            bulk = 0 if weights is None else weights.nbytes
            return records.Frame(answer.SerializeToString(), bulk=bulk), weights
        except Exception as exc:
            return answer_failing(self.door, exc), None

    def _bulk(self, request: pb.PushPullRequest) -> int:
        """The gradient bytes ``request`` says follow it, its payloads checked first.

        Raises:
            InvalidRequest: a step that is neither, names the segment, or that
                ``Steps.check_step`` refuses (a push header inconsistent with the model, a
                pull in int8, a pull not after its push).
        """
        asks_push, asks_pull = request.HasField("push"), request.HasField("pull")
        if not (asks_push or asks_pull):
            raise InvalidRequest("A step asks for neither a push nor a pull.")
        if (asks_push and request.push.shm) or (asks_pull and request.pull.shm):
            raise InvalidRequest("The data port carries payloads, not shared-memory steps.")
        self.steps.check_step(request)  # whole, before any of it is applied
        if not asks_push:
            return 0
        return 0 if request.push.empty else int(request.push.total_bytes)

    @contextmanager
    def _received(
        self, conn: socket.socket, frame: records.Frame, nbytes: int, scan: Scan | None
    ) -> Iterator[Loan | None]:
        """The gradient's ``nbytes`` bytes while the block runs, in a buffer the server
        lends (None for none), each piece handed to ``scan`` as it arrives."""
        if not nbytes:
            yield None
            return
        with self.steps.payloads.lent(nbytes) as loan:
            wait = frame.seconds if frame.seconds > 0 else SEND_SECONDS
            deadline = time.monotonic() + wait + BULK_MARGIN
            behind = Behind(scan) if scan is not None else None  # checks while bytes arrive
            try:
                records.recv_bulk(conn, loan.bytes.data, deadline, behind)
            finally:
                if behind is not None:
                    behind.wait()
            yield loan


def data_port(steps: Steps, config: ServerConfig, latency: Any) -> DataPort | None:
    """The data port ``config`` asks for (``--data-port``), not yet started; None for
    ``off``. ``latency``: the metrics' histogram of its steps."""
    port = config.data_port_number
    if port is None:
        return None
    return DataPort(steps, config.security, config.host, port, latency.observe)
