"""The same-host control socket (server/doors/doorbell.py) against hostile and broken local peers:
silent connections hold no threads and are closed after the hello deadline, every malformed
hello is refused with a reply and no traceback, a worker holds one authenticated connection
at most, and a peer of another user is refused even with the right worker id and nonce. A
real worker keeps stepping through the socket meanwhile."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

import paramserver as ps
from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import records
from paramserver.transport import shm
from paramserver.transport.channels import ControlSocket

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm here")

WAIT = 10.0  # seconds any wait here may take (the server answers within its hello deadline)
HELLO = 0.5  # the hello deadline the tests give the server (2 s by default)
NOBODY = 65534


def _code(code: grpc.StatusCode) -> int:
    return records.number(code)


def _grads(worker: ps.Worker) -> None:
    for p in worker.model.parameters():
        p.grad = torch.ones_like(p)


def _steps(worker: ps.Worker, n: int) -> None:
    for _ in range(n):
        _grads(worker)
        worker.step(samples=1)


def _credentials(worker: ps.Worker) -> tuple[str, bytes]:
    """The control socket's name and the worker's segment nonce."""
    session = worker.sessions[0]
    return session.reply.shm_control, session.channel.segment.nonce


def _dial(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + name)  # blocking: a connect with a timeout fails on a full backlog
    sock.settimeout(WAIT)
    return sock


def _frame(payload: bytes) -> bytes:
    return records.HEADER.pack(len(payload), 0, 0.0, 0) + payload


def _refusal(sock: socket.socket) -> records.Frame:
    """The one frame the server answered before it closed the connection."""
    frame = records.recv(sock)
    assert frame is not None, "the server closed without a reply"
    assert frame.code != records.OK, "the server accepted the hello"
    # closed with our unread bytes in its queue, it resets: closed too
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(1) == b"", "the server kept the connection open after refusing"
    return frame


def _doorbell_threads() -> int:
    return sum(t.name.startswith("ps-doorbell") for t in threading.enumerate())


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)  # another thread's progress; bounded by the deadline


@pytest.fixture
def unhandled(monkeypatch) -> list[threading.ExceptHookArgs]:
    """Exceptions that escaped a thread (each would print a traceback)."""
    escaped: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    return escaped


def test_silent_connections_are_capped_and_closed_after_the_hello_deadline(serve, unhandled):
    server = serve("mlp", workers=2, min_workers=1, policy="async")
    server.doorbell.hello_seconds = HELLO
    cap = getattr(server.doorbell, "max_pending", 16)
    with ps.Worker(server.address) as worker:
        assert worker.control_active
        name, _ = _credentials(worker)
        before, threads = _doorbell_threads(), threading.active_count()
        silent: list[socket.socket] = []
        try:
            for _ in range(300):
                silent.append(_dial(name))
            # one thread at most for each connection not yet authenticated, up to the cap
            assert _doorbell_threads() <= before + cap
            assert threading.active_count() <= threads + cap + 8  # gRPC's pool may grow a bit
            _steps(worker, 3)  # the worker's steps still go through the socket
            assert worker.control_active and server.status()["version"] == 3
            started = time.monotonic()
            codes = [_refusal(s).code for s in silent]
            assert time.monotonic() - started < WAIT / 2
        finally:
            for s in silent:
                s.close()
        late = _code(grpc.StatusCode.DEADLINE_EXCEEDED)
        full = _code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        # the first ones waited for their hello (more, where dialing took a deadline's
        # time), and the others, past the cap, were refused at once
        assert set(codes) <= {late, full} and codes.count(late) > 0 and codes.count(full) > 0
        _wait(lambda: _doorbell_threads() <= before, "the silent connections' threads to end")
        with ps.Worker(server.address) as again:  # the socket admits workers again
            assert again.control_active
            _steps(again, 1)
        _steps(worker, 1)
        assert worker.control_active and server.status()["version"] == 5
    assert not unhandled


def test_every_malformed_hello_is_refused_with_a_reply(serve, unhandled, caplog):
    caplog.set_level(logging.INFO, logger="paramserver")
    server = serve("mlp", workers=1, policy="async")
    server.doorbell.hello_seconds = HELLO
    with ps.Worker(server.address) as worker:
        name, nonce = _credentials(worker)
        me = worker.worker_id.encode()
        invalid = _code(grpc.StatusCode.INVALID_ARGUMENT)
        unauthenticated = _code(grpc.StatusCode.UNAUTHENTICATED)
        late = _code(grpc.StatusCode.DEADLINE_EXCEEDED)
        cases = {  # what the peer sends, whether it then stops writing, the refusal's code
            "worker id not UTF-8": (_frame(nonce + b"\xff\xfe\xc3"), False, invalid),
            "empty hello": (_frame(b""), False, invalid),
            "shorter than a nonce": (_frame(b"abc"), False, invalid),
            "nonce without a worker id": (_frame(nonce), False, invalid),
            "longer than a frame": (
                records.HEADER.pack(records.MAX_PAYLOAD + 1, 0, 0.0, 0),
                False,
                invalid,
            ),
            "longer than a hello": (_frame(nonce + b"w" * 65_536), False, invalid),
            "garbage header": (b"\xff" * records.HEADER.size, False, invalid),
            "truncated header": (_frame(nonce + me)[:9], True, invalid),
            "truncated payload": (_frame(nonce + me)[:-3], True, invalid),
            "stalled payload": (_frame(nonce + me)[:-3], False, late),
            "wrong nonce": (_frame(b"x" * shm.NONCE_BYTES + me), False, unauthenticated),
            "unknown worker": (_frame(nonce + b"nobody"), False, unauthenticated),
        }
        for what, (data, stop, code) in cases.items():
            with _dial(name) as sock:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    sock.sendall(data)  # the server may refuse before it read everything
                if stop:
                    sock.shutdown(socket.SHUT_WR)
                got = _refusal(sock)
                assert got.code == code, f"{what}: {got}"
        _steps(worker, 2)
        assert worker.control_active and server.status()["version"] == 2
    assert not unhandled
    assert not [r for r in caplog.records if r.exc_info], "a traceback in the log"


def test_a_worker_has_one_authenticated_connection_at_most(serve, unhandled):
    server = serve("mlp", workers=1, policy="async")
    with ps.Worker(server.address) as worker:
        name, nonce = _credentials(worker)
        before = _doorbell_threads()
        hellos = [ControlSocket(name, worker.worker_id, nonce, WAIT) for _ in range(20)]
        try:
            # each hello ends the worker's connection before it: one thread, the last's
            _wait(lambda: _doorbell_threads() <= before, "the replaced connections to end")
            for earlier in hellos[:-1]:
                assert records.recv(earlier.sock) is None
            with pytest.raises(grpc.RpcError) as err:  # the last one is served: no slot 9
                hellos[-1].push_pull(_no_slot(worker), WAIT)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            for control in hellos:
                control.close()
        _steps(worker, 1)  # its own connection was replaced: the step goes over gRPC
        assert not worker.control_active and server.status()["version"] == 1
    assert not unhandled


def _no_slot(worker: ps.Worker) -> pb.PushPullRequest:
    header = pb.PushHeader(
        worker_id=worker.worker_id,
        iteration=worker.clock,
        shm=True,
        incarnation=worker.incarnation,
        samples=1,
        shm_slot=9,
    )
    return pb.PushPullRequest(push=header)


# Run by a fresh interpreter (forking this process, with gRPC's and torch's threads, can
# crash the child): it imports what it needs, becomes the user argv[1], says the hello
# argv[3] (hex) to the socket argv[2], and prints the reply's status code (waiting argv[4] s).
_AS_USER = """
import os, socket, struct, sys
uid = int(sys.argv[1])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("\\0" + sys.argv[2])
sock.settimeout(float(sys.argv[4]))
try:
    sock.sendall(bytes.fromhex(sys.argv[3]))
except (BrokenPipeError, ConnectionResetError):
    pass
head = b""
while len(head) < 16 and (chunk := sock.recv(16 - len(head))):
    head += chunk
print(struct.unpack("<Iid", head)[1] if len(head) == 16 else "closed")
"""


def _connect_as(uid: int, name: str, hello: bytes) -> str:
    """What a process running as ``uid`` gets back from the control socket for ``hello``:
    the reply's status code, or "closed"."""
    child = subprocess.run(
        [sys.executable, "-c", _AS_USER, str(uid), name, hello.hex(), str(WAIT)],
        capture_output=True,
        text=True,
        timeout=WAIT * 2,
    )
    assert child.returncode == 0, child.stderr
    return child.stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_a_peer_of_another_user_is_refused_even_with_the_right_nonce(serve, caplog):
    caplog.set_level(logging.INFO, logger="paramserver")
    server = serve("mlp", workers=1, policy="async")
    with ps.Worker(server.address) as worker:
        name, nonce = _credentials(worker)
        hello = _frame(nonce + worker.worker_id.encode())
        assert _connect_as(NOBODY, name, hello) == str(_code(grpc.StatusCode.PERMISSION_DENIED))
        assert any(f"uid {NOBODY}" in r.getMessage() for r in caplog.records)
        _steps(worker, 2)  # the worker's own connection is untouched
        assert worker.control_active and server.status()["version"] == 2
