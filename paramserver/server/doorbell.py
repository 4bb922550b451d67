"""The server's same-host control path: a Unix socket that carries each step's PushPull of
the workers whose shared-memory segment it mapped, instead of a gRPC call.

``paramserver bench wakeup`` measured the candidates on the 2-core machine: a gRPC unary
call takes 440-470 us a round trip and 180-190 us of the caller's CPU; a Unix socket, a
pipe, an eventfd pair, a POSIX semaphore pair and a futex in shared memory all take
60-75 us and 15-30 us. The socket is chosen for what the others lack: a kill -9 of either
side ends the connection at once (the other side reads EOF), a connection authenticates
once (its hello names the worker and the segment's nonce), and it needs no ctypes.

The name is in Linux's abstract namespace (nothing in the file system to clean up). One
thread per connection reads a frame (``codec/records.py``), hands it to ``Steps`` (the same
checks and coordinator calls as the gRPC ``PushPull``) and writes the answer. Join,
heartbeat, leave, status and the first pull stay on gRPC; leases work as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import records
from paramserver.errors import InvalidRequest, ParamServerError, Unauthenticated, to_status
from paramserver.server.steps import Steps
from paramserver.shm import NONCE_BYTES, Attachments

log = logging.getLogger(__name__)


class Doorbell:
    """Listens on ``name`` (abstract) once started; ``close()`` ends every connection."""

    def __init__(
        self,
        steps: Steps,
        shared: Attachments,
        wake: Callable[[], None],
        observe: Callable[[float], None] = lambda seconds: None,
    ):
        self.steps = steps
        self.shared = shared
        self.wake = wake  # wakes pulls waiting for the policy (they see the end)
        self.observe = observe  # each step's time to serve (the metrics' histogram)
        self.name = f"paramserver-{os.getpid()}-{secrets.token_hex(8)}"
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False

    def start(self) -> str:
        """Bind and accept in a thread; the name to offer, or "" where no socket can bind."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + self.name)
            listener.listen(64)
        except OSError as exc:
            listener.close()
            log.warning("no same-host control socket (%s): steps go over gRPC", exc)
            return ""
        self._listener = listener
        threading.Thread(target=self._accept, name="ps-doorbell", daemon=True).start()
        return self.name

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="ps-doorbell-conn",
                             daemon=True).start()  # fmt: skip

    def _serve(self, conn: socket.socket) -> None:
        worker_id = ""
        try:
            worker_id = self._hello(conn)
            while worker_id and (frame := records.recv(conn)) is not None:
                started = time.perf_counter()
                answer = self._answer(worker_id, frame)
                self.observe(time.perf_counter() - started)
                records.send(conn, answer)
        except (OSError, ParamServerError) as exc:
            log.info("control socket of worker %s closed: %s", worker_id or "?", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket) -> str:
        """The worker id the connection's first frame authenticates, or "" (answered)."""
        frame = records.recv(conn)
        if frame is None:
            return ""
        nonce, worker_id = frame.payload[:NONCE_BYTES], frame.payload[NONCE_BYTES:].decode()
        if not self.shared.authenticates(worker_id, nonce):
            why = f"No segment of worker {worker_id!r} with that nonce is mapped here; join again."
            records.send(conn, _failure(Unauthenticated(why)))
            return ""
        records.send(conn, records.Frame(b""))
        return worker_id

    def _answer(self, worker_id: str, frame: records.Frame) -> records.Frame:
        try:
            try:
                request = pb.PushPullRequest.FromString(frame.payload)
            except DecodeError:
                raise InvalidRequest("A control frame that is not a PushPullRequest.") from None
            ids = {request.push.worker_id} | (
                {request.pull.worker_id} if request.HasField("pull") else set()
            )
            if ids != {worker_id}:
                raise Unauthenticated(f"This connection is worker {worker_id}'s, not {ids}.")
            remaining = frame.seconds if frame.seconds > 0 else None
            reply = self.steps.push_pull(request, remaining, self._open)
            return records.Frame(reply.SerializeToString())
        except ParamServerError as exc:
            return _failure(exc)
        except Exception:
            log.exception("a step on the control socket failed")
            code = records.number(grpc.StatusCode.INTERNAL)
            return records.Frame(b"PushPull failed on the server; see its log.", code)

    def _open(self) -> bool:
        return not self._closed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # the worker reads EOF and goes to gRPC
        self.wake()


def _failure(exc: ParamServerError) -> records.Frame:
    code, details = to_status(exc)
    return records.Frame(details.encode(), records.number(code))
