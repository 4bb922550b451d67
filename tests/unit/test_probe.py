"""A client pointed at a port that answers but not as gRPC (a server's data port, its
metrics port, a TLS port without --tls-ca) is told so at once, not after its timeout
(transport/probe.py, issue 46 item 3)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from paramserver.errors import ServerUnavailable
from paramserver.transport import probe
from paramserver.transport.stub import connect

TIMEOUT = 60.0  # a wait that would take this long: the tests end long before it


@pytest.fixture
def answering() -> Iterator:
    """A TCP server on 127.0.0.1 that answers each connection with ``reply`` (None: says
    nothing and keeps it open until the test ends)."""
    made: list[socket.socket] = []
    done = threading.Event()

    def start(reply: bytes | None) -> str:
        sock = socket.create_server(("127.0.0.1", 0))
        made.append(sock)

        def serve() -> None:
            while not done.is_set():
                try:
                    conn, _ = sock.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(64)
                    if reply is None:
                        done.wait(TIMEOUT)
                    else:
                        conn.sendall(reply)

        threading.Thread(target=serve, daemon=True).start()
        return f"127.0.0.1:{sock.getsockname()[1]}"

    yield start
    done.set()
    for sock in made:
        sock.close()


def _refused_at_once(address: str) -> str:
    started = time.monotonic()
    with pytest.raises(ServerUnavailable) as caught:
        connect(address, TIMEOUT)
    assert time.monotonic() - started < TIMEOUT / 4  # at once: not the timeout
    message = str(caught.value)
    assert message.startswith(f"{address} is not a parameter server's port: ")
    return message


def test_a_servers_data_port_is_named_as_such(serve):
    server = serve(workers=1)
    data = server.data.port
    assert data and server.port != data
    message = _refused_at_once(f"127.0.0.1:{data}")
    assert "the framing of a paramserver data port" in message
    assert "'paramserver server listening on' line" in message
    connect(f"127.0.0.1:{server.port}", TIMEOUT).close()  # its gRPC port: connects


def test_http_and_tls_ports_are_named(answering):
    metrics = answering(b"HTTP/1.0 400 Bad request version\r\n\r\n")
    assert "an HTTP/1 server (it answered 'HTTP/1.0 400" in _refused_at_once(metrics)
    page = answering(b"<!DOCTYPE HTML>\n<html><body>400</body></html>")
    assert "a metrics port?" in _refused_at_once(page)
    tls = answering(bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x46]))  # an alert record
    assert "it speaks TLS: pass --tls-ca" in _refused_at_once(tls)
    other = answering(b"SSH-2.0-OpenSSH_9.6\r\n")
    assert "it answered b'SSH-2.0-OpenSSH_', not HTTP/2" in _refused_at_once(other)


def test_nothing_certain_keeps_the_wait(answering):
    """A silent peer, a closed connection, nothing listening or an HTTP/2 SETTINGS frame
    prove nothing: the client waits as before (its timeout and message unchanged)."""
    assert probe.not_grpc(answering(None), timeout=0.5) is None  # silent
    assert probe.not_grpc(answering(b""), timeout=2.0) is None  # closed at once
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    assert probe.not_grpc(f"127.0.0.1:{port}") is None  # nothing listens
    assert probe.what_answered(bytes([0, 0, 6, 4, 0, 0, 0, 0, 0])) is None  # HTTP/2
    assert probe.not_grpc("unix:/tmp/socket") is None and probe.host_port("x") is None
    assert probe.host_port("[::1]:50051") == ("::1", 50051)
    with pytest.raises(ServerUnavailable, match="No parameter server answered"):
        connect(answering(b""), 1.5)  # said after its timeout, as before
