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
user may do is bounded too:

- a connection must send its hello within ``hello_seconds`` (``HELLO_SECONDS``), all of it;
- at most ``max_pending`` (``MAX_PENDING``) connections may be waiting for their hello, each
  with its thread; the next is refused at once, without a thread;
- an authenticated connection is its worker's only one (a worker that says hello again
  replaces its earlier connection), so there are no more of them than workers whose
  segment is mapped (``Attachments``) when they say hello.

A refusal is one failure frame (a status code and why, as a gRPC call's), then the server
closes the connection; refusals are counted in ``refusals`` and logged once a minute per
reason, never with a traceback. One thread per connection reads a frame
(``codec/records.py``), hands it to ``Steps`` (the same checks and coordinator calls as the
gRPC ``PushPull``) and writes the answer. Join, heartbeat, leave, status and the first pull
stay on gRPC; leases work as before.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import records
from paramserver.errors import (
    InvalidRequest,
    ParamServerError,
    Timeout,
    Unauthenticated,
    to_status,
)
from paramserver.server.steps import Steps
from paramserver.transport.shm import NONCE_BYTES, Attachments

log = logging.getLogger(__name__)

HELLO_SECONDS = 2.0  # a connection's whole hello must arrive within this, or it is refused
MAX_PENDING = 16  # connections waiting for their hello at once; the next is refused at once
MAX_WORKER_ID = 256  # bytes of a hello's worker id (the server's ids are far shorter)
REPLY_SECONDS = 1.0  # how long writing a refusal may take before the connection just closes
RETRY_SECONDS = 0.05  # after accept() failed (out of file descriptors): wait, then accept again
LOG_EVERY = 60.0  # seconds between two log lines about refusals of one reason
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Refusals:
    """Connections refused, counted by reason; the first of each reason is logged, then one
    line a minute at most (a flood is a line, not thousands)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._logged: dict[str, float] = {}
        self._lock = threading.Lock()

    def note(self, reason: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[reason] += 1
            count, last = self.counts[reason], self._logged.get(reason)
            due = last is None or now - last >= LOG_EVERY
            if due:
                self._logged[reason] = now
        if due:
            log.warning(
                "control socket: refused a connection (%s: %s); %d so far for that",
                reason,
                detail,
                count,
            )


class Doorbell:
    """Listens on ``name`` (abstract) once started; ``close()`` ends every connection."""

    def __init__(
        self,
        steps: Steps,
        shared: Attachments,
        wake: Callable[[], None],
        observe: Callable[[float], None] = lambda seconds: None,
        hello_seconds: float = HELLO_SECONDS,
        max_pending: int = MAX_PENDING,
    ):
        self.steps = steps
        self.shared = shared
        self.wake = wake  # wakes pulls waiting for the policy (they see the end)
        self.observe = observe  # each step's time to serve (the metrics' histogram)
        self.hello_seconds = hello_seconds
        self.max_pending = max_pending
        self.refusals = Refusals()
        self.name = f"paramserver-{os.getpid()}-{secrets.token_hex(8)}"
        self._uids = {0, os.geteuid()}  # the peers' users allowed: this one's, and root
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._pending = 0  # connections whose hello is awaited (each has a thread)
        self._workers: dict[str, socket.socket] = {}  # the authenticated, by worker id
        self._closed = False

    def start(self) -> str:
        """Bind and accept in a thread; the name to offer, or "" where no socket can bind."""
        if not hasattr(socket, "SO_PEERCRED"):
            log.warning("no same-host control socket (no SO_PEERCRED here): steps go over gRPC")
            return ""
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
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closed or exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # closed
                self.refusals.note("accept failed", str(exc))  # EMFILE and the like
                time.sleep(RETRY_SECONDS)  # the descriptors free up as connections end
                continue
            try:
                self._admit(conn)
            except Exception:  # a bug: the listener must go on
                log.exception("control socket: admitting a connection failed")
                conn.close()
        self._listener.close()

    def _admit(self, conn: socket.socket) -> None:
        """Start ``conn``'s thread, or refuse it at once: another user, or too many pending."""
        try:
            pid, uid, _ = _CRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
            )
        except OSError as exc:
            why = f"Cannot tell who is on the other end of the control socket ({exc})."
            return self._refuse_now(conn, grpc.StatusCode.PERMISSION_DENIED, why, "no peer")
        if uid not in self._uids:
            why = f"The control socket serves user {os.geteuid()}'s processes, not user {uid}'s."
            return self._refuse_now(
                conn,
                grpc.StatusCode.PERMISSION_DENIED,
                why,
                "another user",
                f"pid {pid}, uid {uid}",
            )
        with self._lock:
            closed, full = self._closed, self._pending >= self.max_pending
            if not (closed or full):
                self._pending += 1
                self._conns.add(conn)
        if closed:
            conn.close()
            return None
        if full:
            why = f"{self.max_pending} control connections are already waiting for their hello."
            return self._refuse_now(
                conn, grpc.StatusCode.RESOURCE_EXHAUSTED, why, "too many pending", f"pid {pid}"
            )
        try:
            threading.Thread(
                target=self._serve, args=(conn,), name="ps-doorbell-conn", daemon=True
            ).start()
        except RuntimeError as exc:  # can't start new thread
            self._forget(conn, "", pending=True)
            self._refuse_now(
                conn,
                grpc.StatusCode.UNAVAILABLE,
                f"No thread for it: {exc}.",
                "no thread",
                str(exc),
            )
        return None

    def _refuse_now(
        self, conn: socket.socket, code: grpc.StatusCode, why: str, reason: str, detail: str = ""
    ) -> None:
        """Refuse from the accept thread: a reply that never blocks (a fresh connection's
        buffer is empty), then close."""
        self.refusals.note(reason, detail or why)
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            conn.send(records.encode(records.failure(code, why)))
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        worker_id = ""
        try:
            worker_id = self._hello(conn)
            if worker_id:
                self._steps(conn, worker_id)
        except Exception:  # a bug: logged with its context, and the connection ends
            log.exception("control socket of worker %s failed; closing it", worker_id or "?")
        finally:
            self._forget(conn, worker_id)
            conn.close()

    def _hello(self, conn: socket.socket) -> str:
        """The worker id the connection's first frame authenticates, or "" (refused)."""
        worker_id = ""
        limit = NONCE_BYTES + MAX_WORKER_ID
        try:
            frame = records.recv(conn, limit, time.monotonic() + self.hello_seconds)
            if frame is None:
                log.debug("a control connection closed before its hello")
                return ""
            worker_id = self._authenticate(frame.payload)
        except TimeoutError:
            self._refuse(conn, Timeout(f"No hello within {self.hello_seconds:g} s."), "no hello")
        except ConnectionError as exc:  # the peer closed inside the hello
            self._refuse(conn, InvalidRequest(f"A truncated hello: {exc}."), "truncated hello")
        except OSError as exc:
            log.debug("a control connection failed before its hello: %s", exc)
        except ParamServerError as exc:
            self._refuse(conn, exc, f"hello {type(exc).__name__}")
        finally:
            self._authenticated(conn, worker_id)
        return worker_id

    def _authenticate(self, payload: bytes) -> str:
        """The worker id of a hello (the segment's nonce, then the id in UTF-8).

        Raises:
            InvalidRequest: the hello is malformed.
            Unauthenticated: no segment of that worker with that nonce is mapped here.
        """
        if len(payload) <= NONCE_BYTES:
            raise InvalidRequest(
                f"A hello of {len(payload)} bytes: the segment's {NONCE_BYTES}-byte nonce, "
                "then the worker id."
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

    def _authenticated(self, conn: socket.socket, worker_id: str) -> None:
        """The hello is over: ``conn`` is ``worker_id``'s connection (or refused if "");
        the worker's earlier connection, if any, ends."""
        with self._lock:
            self._pending -= 1
            earlier = self._workers.get(worker_id) if worker_id else None
            if worker_id:
                self._workers[worker_id] = conn
        if earlier is not None:
            log.info("worker %s opened another control connection; its earlier one ends", worker_id)
            with contextlib.suppress(OSError):
                earlier.shutdown(socket.SHUT_RDWR)  # its thread reads EOF and ends

    def _steps(self, conn: socket.socket, worker_id: str) -> None:
        """Answer ``worker_id``'s frames until it closes the connection."""
        try:
            conn.settimeout(None)  # steps may be far apart
            records.send(conn, records.Frame(b""))
            while (frame := records.recv(conn)) is not None:
                started = time.perf_counter()
                answer = self._answer(worker_id, frame)
                self.observe(time.perf_counter() - started)
                records.send(conn, answer)
        except OSError as exc:
            log.info("control socket of worker %s closed: %s", worker_id, exc)
        except ParamServerError as exc:  # a frame too long: the stream is lost
            self._refuse(conn, exc, f"worker {type(exc).__name__}")

    def _refuse(self, conn: socket.socket, exc: ParamServerError, reason: str) -> None:
        """Answer ``exc`` on ``conn`` (best effort, briefly); the caller closes it."""
        self.refusals.note(reason, str(exc))
        with contextlib.suppress(OSError):
            conn.settimeout(REPLY_SECONDS)
            records.send(conn, _failure(exc))

    def _forget(self, conn: socket.socket, worker_id: str, pending: bool = False) -> None:
        with self._lock:
            self._conns.discard(conn)
            if pending:
                self._pending -= 1
            if worker_id and self._workers.get(worker_id) is conn:
                del self._workers[worker_id]

    def _answer(self, worker_id: str, frame: records.Frame) -> records.Frame:
        try:
            try:
                request = pb.PushPullRequest.FromString(frame.payload)
            except DecodeError:
                raise InvalidRequest("A control frame that is not a PushPullRequest.") from None
            ids = {
                getattr(request, part).worker_id
                for part in ("push", "pull")
                if request.HasField(part)
            }
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
            self._workers.clear()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # the worker reads EOF and goes to gRPC
        self.wake()


def _failure(exc: ParamServerError) -> records.Frame:
    return records.failure(*to_status(exc))
