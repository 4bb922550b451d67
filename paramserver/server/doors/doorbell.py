"""The server's same-host control path: a Unix socket that carries each step's PushPull of
the workers whose shared-memory segment it mapped, instead of a gRPC call.

``paramserver bench wakeup`` measured the candidates on the 2-core machine: a gRPC unary
call takes 440-470 us a round trip and 180-190 us of the caller's CPU; a Unix socket, a
pipe, an eventfd pair, a POSIX semaphore pair and a futex in shared memory all take
60-75 us and 15-30 us. The socket is chosen for what the others lack: a kill -9 of either
side ends the connection at once (the other side reads EOF), a connection authenticates
once (its hello names the worker and the segment's nonce), and it needs no ctypes.

The name is in Linux's abstract namespace: nothing in the file system to clean up, but any
local process can read it (``/proc/net/unix``) and connect, whatever its user, since an
abstract name has no permissions. So the kernel's word on the peer decides instead of a
0700 run folder (which would need a path, a cleanup after kill -9, and a folder both sides
agree on): a peer whose ``SO_PEERCRED`` uid is neither the server's nor root's is refused
at accept, before it may send anything (so the workers of another user that a root server
serves step over gRPC, their payloads still in their segments). What a peer of the same
user may do is bounded as on every socket door (``listener.py``): a hello within 2 s, at
most 16 waiting for theirs, one connection a worker. A hello is the segment's nonce, then
the worker id; each frame after it is a ``PushPullRequest`` whose payloads are in the
segment, handed to ``Steps`` (the same checks and coordinator calls as the gRPC
``PushPull``). Join, heartbeat, leave, status and the first pull stay on gRPC; leases work
as before.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import records
from paramserver.errors import InvalidRequest, Unauthenticated
from paramserver.server.doors.listener import (
    HELLO_SECONDS,
    MAX_PENDING,
    MAX_WORKER_ID,
    Listener,
    Refusal,
    answer_failing,
)
from paramserver.server.doors.steps import Steps
from paramserver.transport.attachments import Attachments
from paramserver.transport.shm import NONCE_BYTES

log = logging.getLogger(__name__)

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Doorbell(Listener):
    """Listens on ``name`` (abstract) once started; ``close()`` ends every connection."""

    door = "control socket"

    def __init__(
        self,
        steps: Steps,
        shared: Attachments,
        wake: Callable[[], None],
        observe: Callable[[float], None] = lambda seconds: None,
        hello_seconds: float = HELLO_SECONDS,
        max_pending: int = MAX_PENDING,
    ):
        super().__init__(hello_seconds, max_pending)
        self.steps = steps
        self.shared = shared
        self.wake = wake  # wakes pulls waiting for the policy (they see the end)
        self.observe = observe  # each step's time to serve (the metrics' histogram)
        self.name = f"paramserver-{os.getpid()}-{secrets.token_hex(8)}"
        self._uids = {0, os.geteuid()}  # the peers' users allowed: this one's, and root

    def start(self) -> str:
        """Bind and accept in a thread; the name to offer, or "" where no socket can bind."""
        if not hasattr(socket, "SO_PEERCRED"):
            log.warning("no same-host control socket (no SO_PEERCRED here): steps go over gRPC")
            return ""
        return self.name if self.listen() else ""

    def _bind(self) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + self.name)
            listener.listen(64)
        except OSError:
            listener.close()
            raise
        return listener

    def _vet(self, conn: socket.socket) -> None:
        """Another user's process is refused (the kernel's word on the peer)."""
        try:
            pid, uid, _ = _CRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
            )
        except OSError as exc:
            why = f"Cannot tell who is on the other end of the control socket ({exc})."
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, why, "no peer") from None
        if uid not in self._uids:
            why = f"The control socket serves user {os.geteuid()}'s processes, not user {uid}'s."
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED, why, "another user", f"pid {pid}, uid {uid}"
            )

    def _authenticate(self, payload: bytes) -> str:
        """The worker id of a hello (the segment's nonce, then the id in UTF-8).

        Raises:
            InvalidRequest: the hello is malformed.
            Unauthenticated: no segment of that worker with that nonce is mapped here.
        """
        if not NONCE_BYTES < len(payload) <= NONCE_BYTES + MAX_WORKER_ID:
            raise InvalidRequest(
                f"A hello of {len(payload)} bytes: the segment's {NONCE_BYTES}-byte nonce, "
                f"then the worker id (at most {MAX_WORKER_ID} bytes)."
            )
        nonce, raw = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
        try:
            worker_id = raw.decode()
        except UnicodeDecodeError:
            raise InvalidRequest(f"A hello whose worker id {raw!r} is not UTF-8.") from None
        if not self.shared.authenticates(worker_id, nonce):
            why = f"No segment of worker {worker_id!r} with that nonce is mapped here; join again."
            raise Unauthenticated(why)
        return worker_id

    def _answer(
        self, worker_id: str, frame: records.Frame, conn: socket.socket
    ) -> tuple[records.Frame, memoryview | None]:
        if frame.bulk:
            raise InvalidRequest(
                "A control frame carries no bulk: the payloads are in the segment."
            )
        started = time.perf_counter()
        try:
            request = parse(frame.payload, worker_id)
            remaining = frame.seconds if frame.seconds > 0 else None
            reply = self.steps.push_pull(request, remaining, self._open)
            answer = records.Frame(reply.SerializeToString())
        except Exception as exc:
            answer = answer_failing(self.door, exc)
        self.observe(time.perf_counter() - started)
        return answer, None

    def close(self) -> None:
        super().close()
        self.wake()


def parse(payload: bytes, worker_id: str) -> pb.PushPullRequest:
    """A step's request, for the connection of ``worker_id``.

    Raises:
        InvalidRequest: it is not a PushPullRequest.
        Unauthenticated: it names another worker.
    """
    try:
        request = pb.PushPullRequest.FromString(payload)
    except DecodeError:
        raise InvalidRequest("A frame that is not a PushPullRequest.") from None
    ids = {getattr(request, part).worker_id for part in ("push", "pull") if request.HasField(part)}
    if ids != {worker_id}:
        raise Unauthenticated(f"This connection is worker {worker_id}'s, not {ids}.")
    return request
