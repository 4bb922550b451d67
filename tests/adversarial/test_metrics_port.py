"""The metrics endpoint under a peer that opens connections and sends nothing, or sends a
byte now and then: it holds at most PER_PEER of the server's threads, each for at most
DEADLINE_SECONDS, and another address scrapes meanwhile. prometheus_client's own server
gave each connection a thread for as long as the peer kept it open."""

from __future__ import annotations

import socket
import threading

from paramserver.server import metrics_http
from tests.conftest import DEADLINE, tiny_model, wait_until

SCRAPER = "127.0.0.2"  # Prometheus, at another address than the peer's (127.0.0.1)


def _serving_threads() -> int:
    """The metrics server's connection threads (socketserver names them so)."""
    return sum(1 for t in threading.enumerate() if t.name.endswith("(process_request_thread)"))


def _scrape(port: int, source: str = SCRAPER) -> str:
    """GET /metrics from ``source`` (a loopback address of its own)."""
    with socket.create_connection(("127.0.0.1", port), DEADLINE, (source, 0)) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def test_a_peers_idle_connections_hold_two_threads_and_others_scrape(serve, monkeypatch):
    monkeypatch.setattr(metrics_http, "IDLE_SECONDS", DEADLINE)  # none times out meanwhile
    monkeypatch.setattr(metrics_http, "DEADLINE_SECONDS", DEADLINE)
    server = serve(tiny_model(), policy="async", host="127.0.0.1", metrics_port=0)
    port, http = server.metrics.port, server.metrics._http
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
    try:
        wait_until(lambda: http.refused >= 64 - metrics_http.PER_PEER, "the rest refused")
        assert _serving_threads() <= metrics_http.PER_PEER
        assert "paramserver_version" in _scrape(port)  # another address is served
    finally:
        for s in idle:
            s.close()


def test_a_connection_is_closed_when_idle_or_past_its_deadline(serve, monkeypatch):
    monkeypatch.setattr(metrics_http, "IDLE_SECONDS", 0.5)
    monkeypatch.setattr(metrics_http, "DEADLINE_SECONDS", 1.0)
    server = serve(tiny_model(), policy="async", host="127.0.0.1", metrics_port=0)
    port = server.metrics.port
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(DEADLINE)
        assert s.recv(1) == b""  # silent: closed
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(DEADLINE)
        s.sendall(b"G")
        tick, closed = threading.Event(), threading.Event()

        def drip() -> None:  # a byte every 0.3 s, under the idle time: only the deadline ends it
            try:
                while not closed.is_set() and not tick.wait(0.3):
                    s.sendall(b"E")
            except OSError:
                pass

        threading.Thread(target=drip, daemon=True).start()
        try:
            assert s.recv(1) in (b"", b"H")  # closed by its deadline (or a 400 first)
            while s.recv(4096):
                pass
        finally:
            closed.set()
    assert "paramserver_version" in _scrape(port, "127.0.0.1")
