"""What the server's socket doors share: the same-host control socket (``doorbell.py``) and
the data port other hosts use (``dataport.py``). A ``Listener`` accepts connections on its
own thread and gives each a thread of its own that reads its hello, then its steps, one
frame (``codec/records.py``) at a time, and writes each answer.

What a peer may do before it has authenticated is bounded the same way on both doors:

- a connection must finish its handshake (TLS, on the data port) and send its whole hello
  within ``hello_seconds`` (``HELLO_SECONDS``);
- at most ``max_pending`` (``MAX_PENDING``) connections may be waiting for their hello, each
  with its thread; the next is refused at once, without a thread. A connection counts as
  waiting from its accept until its hello is over, however it ends: a failed TLS handshake,
  a peer that closed, a refusal (a port scanner's 16 probes once shut the TLS data port
  for the server's life);
- a refusal on a door that speaks TLS goes out inside TLS, so the worker reads why: one
  thread (``ps-<door>-refuser``) shakes hands with at most ``REFUSING`` refused peers at
  a time, ``REPLY_SECONDS`` each; past that, a refused connection is just closed;
- a hello is at most ``HELLO_BYTES`` long; nothing it says is acted on before it is checked;
- an authenticated connection is its worker's only one (a worker that says hello again
  replaces its earlier connection), so there are no more of them than workers.

A refusal is one failure frame (a status code and why, as a gRPC call's), then the server
closes the connection; refusals are counted in ``refusals`` and logged once a minute per
reason, never with a traceback. A frame the connection cannot go on after (too long, a
bulk that does not match its request) is answered with its failure and the connection
ends. A subclass says how to bind (``_bind``), whom to turn away before a thread
(``_vet``), how to wrap a connection (``_handshake``), whom a hello names
(``_authenticate``) and how to answer a step (``_answer``).
"""

from __future__ import annotations

import abc
import collections
import contextlib
import errno
import logging
import os
import queue
import socket
import threading
import time

import grpc

from paramserver.codec import records
from paramserver.errors import InvalidRequest, ParamServerError, Timeout, to_status

log = logging.getLogger(__name__)

HELLO_SECONDS = 2.0  # a connection's handshake and whole hello must arrive within this
MAX_PENDING = 16  # connections waiting for their hello at once; the next is refused at once
HELLO_BYTES = 1024  # the longest hello (a token, a nonce and a worker id)
MAX_WORKER_ID = 256  # bytes of a hello's worker id (the server's ids are far shorter)
REPLY_SECONDS = 1.0  # how long writing a refusal may take before the connection just closes
SEND_SECONDS = 60.0  # how long writing an answer may take before the worker is deemed stuck
RETRY_SECONDS = 0.05  # after accept() failed (out of file descriptors): wait, then accept again
LOG_EVERY = 60.0  # seconds between two log lines about refusals of one reason
REFUSING = 16  # refused connections waiting for a TLS handshake to be told why; more: closed


class Refusals:
    """Connections refused, counted by reason; the first of each reason is logged, then one
    line a minute at most (a flood is a line, not thousands)."""

    def __init__(self, door: str) -> None:
        self.door = door
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
                "%s: refused a connection (%s: %s); %d so far for that",
                self.door,
                reason,
                detail,
                count,
            )


class Refusal(Exception):
    """Turn a connection away before its thread: ``code`` and ``why`` are its answer."""

    def __init__(self, code: grpc.StatusCode, why: str, reason: str, detail: str = ""):
        super().__init__(why)
        self.code, self.why, self.reason, self.detail = code, why, reason, detail or why


class Listener(abc.ABC):
    """Accepts on its own thread once started; ``close()`` ends every connection."""

    door = "socket"  # how the log names it
    speaks_tls = False  # whether ``_handshake`` wraps the connection in TLS

    def __init__(self, hello_seconds: float = HELLO_SECONDS, max_pending: int = MAX_PENDING):
        self.hello_seconds = hello_seconds
        self.max_pending = max_pending
        self.refusals = Refusals(self.door)
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._pending = 0  # connections whose hello is awaited (each has a thread)
        self._workers: dict[str, socket.socket] = {}  # the authenticated, by worker id
        self._closed = False
        self._refusing: queue.Queue[tuple[socket.socket, Refusal] | None] = queue.Queue(REFUSING)

    # --- what a door says -----------------------------------------------------------------

    @abc.abstractmethod
    def _bind(self) -> socket.socket:
        """A listening socket. Raises OSError where none can bind."""

    def _vet(self, conn: socket.socket) -> None:  # noqa: B027 - most doors vet no one
        """Raise ``Refusal`` to turn ``conn`` away before it gets a thread."""

    def _handshake(self, conn: socket.socket) -> socket.socket:
        """The connection to talk on (``conn``, or it wrapped); within the socket's timeout.
        Raises OSError (logged and counted, the connection closed) if it fails."""
        return conn

    @abc.abstractmethod
    def _authenticate(self, payload: bytes) -> str:
        """The worker id a hello's payload proves. Raises ParamServerError if none."""

    @abc.abstractmethod
    def _answer(
        self, worker_id: str, frame: records.Frame, conn: socket.socket
    ) -> tuple[records.Frame, memoryview | None]:
        """The answer to one step (and its bulk). A ParamServerError raised ends the
        connection after its failure frame (its bulk may be unread); failures the
        connection survives are answered as failure frames."""

    # --- accepting ------------------------------------------------------------------------

    def where(self) -> str:
        """Where it would listen, for the log ("": its name says it)."""
        return ""

    def listen(self) -> bool:
        """Bind and accept in a thread; False (logged) where nothing can bind."""
        try:
            self._listener = self._bind()
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)  # not bind's raw tuple
            log.warning("no %s%s: %s", self.door, self.where(), why)
            return False
        threading.Thread(target=self._accept, name=f"ps-{self.door}", daemon=True).start()
        if self.speaks_tls:
            threading.Thread(
                target=self._refuser, name=f"ps-{self.door}-refuser", daemon=True
            ).start()
        return True

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
                log.exception("%s: admitting a connection failed", self.door)
                conn.close()
        self._listener.close()

    def _admit(self, conn: socket.socket) -> None:
        """Start ``conn``'s thread, or refuse it at once."""
        try:
            self._vet(conn)
            with self._lock:
                closed, full = self._closed, self._pending >= self.max_pending
                if not (closed or full):
                    self._pending += 1
                    self._conns.add(conn)
            if closed:
                conn.close()
                return
            if full:
                why = f"{self.max_pending} connections are already waiting for their hello."
                raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, why, "too many pending")
            try:
                threading.Thread(
                    target=self._serve, args=(conn,), name=f"ps-{self.door}-conn", daemon=True
                ).start()
            except RuntimeError as exc:  # can't start new thread
                self._forget(conn, "", pending=True)
                raise Refusal(
                    grpc.StatusCode.UNAVAILABLE, f"No thread for it: {exc}.", "no thread"
                ) from None
        except Refusal as refusal:
            self._refuse_now(conn, refusal)

    def _refuse_now(self, conn: socket.socket, refusal: Refusal) -> None:
        """Refuse from the accept thread: a reply that never blocks (a fresh connection's
        buffer is empty), then close. Under TLS the refuser thread says it, in TLS."""
        self.refusals.note(refusal.reason, refusal.detail)
        if self._closed:
            conn.close()
            return
        if self.speaks_tls:
            try:
                self._refusing.put_nowait((conn, refusal))
            except queue.Full:
                self.refusals.note("refused unanswered", "the refuser is busy")
                conn.close()
            return
        with contextlib.suppress(OSError):
            conn.setblocking(False)
            conn.send(records.encode(records.failure(refusal.code, refusal.why)))
        conn.close()

    def _refuser(self) -> None:
        """Tells refused peers why, inside TLS, one at a time and briefly each."""
        while not self._closed:
            try:
                item = self._refusing.get(timeout=1.0)  # also ends when the stop word is lost
            except queue.Empty:
                continue
            if item is None:
                break
            conn, refusal = item
            try:
                conn.settimeout(REPLY_SECONDS)
                wrapped = self._handshake(conn)
                wrapped.settimeout(REPLY_SECONDS)
                records.send(wrapped, records.failure(refusal.code, refusal.why))
                wrapped.close()
            except OSError as exc:  # a peer that is no worker (a scanner): nothing to tell
                log.debug("%s: a refused peer's handshake failed: %s", self.door, exc)
            except Exception:  # a bug: the refuser must go on
                log.exception("%s: telling a refused peer why failed", self.door)
            finally:
                conn.close()
        self._drain_refusing()

    def _drain_refusing(self) -> None:
        """Close the refused connections still queued, unanswered (the door closed)."""
        while True:
            try:
                left = self._refusing.get_nowait()
            except queue.Empty:
                return
            if left is not None:
                left[0].close()

    # --- one connection -------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        worker_id = ""
        waiting = True  # counted in ``_pending`` until the hello is over (``_authenticated``)
        try:
            conn.settimeout(self.hello_seconds)
            conn = self._handshaken(conn)
            waiting = False  # ``_hello`` gives the count back, however it ends
            worker_id = self._hello(conn)
            if worker_id:
                self._steps(conn, worker_id)
        except OSError as exc:  # the handshake failed (a TLS one: no frame can say why)
            self.refusals.note("handshake failed", str(exc))
        except Exception:  # a bug: logged with its context, and the connection ends
            log.exception("%s of worker %s failed; closing it", self.door, worker_id or "?")
        finally:
            self._forget(conn, worker_id, pending=waiting)
            conn.close()

    def _handshaken(self, conn: socket.socket) -> socket.socket:
        wrapped = self._handshake(conn)
        if wrapped is not conn:
            with self._lock:
                self._conns.discard(conn)
                self._conns.add(wrapped)
        return wrapped

    def _hello(self, conn: socket.socket) -> str:
        """The worker id the connection's first frame authenticates, or "" (refused)."""
        worker_id = ""
        try:
            frame = records.recv(conn, HELLO_BYTES, time.monotonic() + self.hello_seconds)
            if frame is None:
                log.debug("%s: a connection closed before its hello", self.door)
                return ""
            if frame.bulk:
                raise InvalidRequest("A hello carries no bulk.")
            worker_id = self._authenticate(frame.payload)
        except TimeoutError:
            self._refuse(conn, Timeout(f"No hello within {self.hello_seconds:g} s."), "no hello")
        except ConnectionError as exc:  # the peer closed inside the hello
            self._refuse(conn, InvalidRequest(f"A truncated hello: {exc}."), "truncated hello")
        except OSError as exc:
            log.debug("%s: a connection failed before its hello: %s", self.door, exc)
        except ParamServerError as exc:
            self._refuse(conn, exc, f"hello {type(exc).__name__}")
        finally:
            self._authenticated(conn, worker_id)
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
            log.info("worker %s opened another %s; its earlier one ends", worker_id, self.door)
            with contextlib.suppress(OSError):
                earlier.shutdown(socket.SHUT_RDWR)  # its thread reads EOF and ends

    def _steps(self, conn: socket.socket, worker_id: str) -> None:
        """Answer ``worker_id``'s frames until it closes the connection."""
        try:
            conn.settimeout(SEND_SECONDS)
            records.send(conn, records.Frame(b""))
            while True:
                conn.settimeout(None)  # steps may be far apart
                frame = records.recv(conn)
                if frame is None:
                    return
                answer, bulk = self._answer(worker_id, frame, conn)
                conn.settimeout(SEND_SECONDS)
                records.send(conn, answer, bulk)
        except OSError as exc:
            log.info("%s of worker %s closed: %s", self.door, worker_id, exc)
        except ParamServerError as exc:  # a frame the stream cannot go on after
            self._refuse(conn, exc, f"worker {type(exc).__name__}")

    def _refuse(self, conn: socket.socket, exc: ParamServerError, reason: str) -> None:
        """Answer ``exc`` on ``conn`` (best effort, briefly); the caller closes it."""
        self.refusals.note(reason, str(exc))
        with contextlib.suppress(OSError):
            conn.settimeout(REPLY_SECONDS)
            records.send(conn, failure(exc))

    def _forget(self, conn: socket.socket, worker_id: str, pending: bool = False) -> None:
        with self._lock:
            self._conns.discard(conn)
            if pending:
                self._pending -= 1
            if worker_id and self._workers.get(worker_id) is conn:
                del self._workers[worker_id]

    def _open(self) -> bool:
        return not self._closed

    @property
    def pending(self) -> int:
        """Connections waiting for their hello now."""
        with self._lock:
            return self._pending

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
            self._workers.clear()
        if self.speaks_tls:
            self._drain_refusing()  # then the refuser ends
            with contextlib.suppress(queue.Full):
                self._refusing.put_nowait(None)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
            self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # the worker reads EOF and goes to gRPC


def failure(exc: ParamServerError) -> records.Frame:
    return records.failure(*to_status(exc))


def answer_failing(door: str, exc: BaseException) -> records.Frame:
    """The failure frame of a step that raised ``exc`` (a bug is logged with its trace)."""
    if isinstance(exc, ParamServerError):
        return failure(exc)
    log.error("a step on the %s failed", door, exc_info=exc)
    code = records.number(grpc.StatusCode.INTERNAL)
    return records.Frame(b"The step failed on the server; see its log.", code)
