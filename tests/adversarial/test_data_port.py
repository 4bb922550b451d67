"""The TLS data port under a port scanner's traffic: failed handshakes give their slot back,
and a peer refused for a full door is told why inside TLS."""

from __future__ import annotations

import socket
import ssl

import pytest

import paramserver as ps
from paramserver.config import Security
from paramserver.server.doors.listener import MAX_PENDING
from paramserver.transport.tcp import DataSocket
from tests.conftest import DEADLINE, ones_step, replica, tiny_model, wait_until


def _tls_server(serve, pki):
    ca = pki["ca"][0]
    sec = Security(cert=pki["server"][0], key=pki["server"][1], ca=ca)
    client = Security(cert=pki["client"][0], key=pki["client"][1], ca=ca)
    model = tiny_model()
    return serve(replica(model), policy="async", security=sec), client, model


def _stranger_context(pki) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki["ca"][0])
    ctx.load_cert_chain(*pki["stranger"])  # a certificate the server's CA did not sign
    ctx.check_hostname = False
    return ctx


def test_a_thousand_failed_handshakes_leave_the_tls_data_port_to_the_workers(serve, pki):
    """Target 1: plain TCP opened and closed (a port scan, a TCP probe), garbage, and TLS
    with a certificate from another CA, 1,000 in all. Each gives its slot back, and a
    worker still steps over the data port (16 were enough to shut it for good)."""
    server, client, model = _tls_server(serve, pki)
    port, stranger = server.data.port, _stranger_context(pki)
    for i in range(1000):
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as s:
            if i % 3 == 1:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)))
            elif i % 3 == 2:
                with pytest.raises(OSError), stranger.wrap_socket(s, server_hostname="::1") as tls:
                    tls.recv(1)  # TLS 1.3: the server's refusal comes after the handshake
    wait_until(lambda: server.data.pending == 0, "every failed handshake's slot given back")
    failed = server.data.refusals.counts
    assert failed["handshake failed"] + failed["too many pending"] >= 1000 - MAX_PENDING
    mine = replica(model)
    with ps.Worker(server.address, mine, security=client, shm=False) as w:
        assert w.data_port_active
        ones_step(w, mine)
    assert server.status()["version"] == 1


def test_a_worker_refused_by_a_full_tls_door_is_told_why_in_tls(serve, pki):
    """16 silent connections fill the door; the 17th, a worker's, is refused with a
    failure frame it can read (sent inside TLS, not in plain text that reads as a TLS
    version error), naming the reason. Once they time out, the worker gets in."""
    server, client, model = _tls_server(serve, pki)
    port = server.data.port
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_PENDING)]
    try:
        wait_until(lambda: server.data.pending == MAX_PENDING, "the door full")
        with ps.Worker(server.address, replica(model), security=client, shm=False) as w:
            nonce = w.sessions[0].reply.data_nonce
            with pytest.raises(Exception, match="already waiting for their hello"):
                DataSocket("127.0.0.1", port, client, w.worker_id, nonce, DEADLINE)
    finally:
        for s in silent:
            s.close()
    wait_until(lambda: server.data.pending == 0, "the silent connections' slots given back")
    with ps.Worker(server.address, replica(model), security=client, shm=False) as w:
        assert w.data_port_active
