"""The metrics endpoint under a peer that opens connections and sends nothing: it holds at
most MAX_SCRAPES of the server's threads, each for IDLE_SECONDS at most, and a scrape gets
its answer once they are gone. prometheus_client's own server gave each connection a thread
for as long as the peer kept it open."""

from __future__ import annotations

import socket
import threading
import urllib.request

from paramserver.server import metrics_http
from tests.conftest import DEADLINE, tiny_model, wait_until


def _serving_threads() -> int:
    """The metrics server's connection threads (socketserver names them so)."""
    return sum(1 for t in threading.enumerate() if t.name.endswith("(process_request_thread)"))


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=DEADLINE) as r:
        return r.read().decode()


def test_idle_connections_hold_a_bounded_number_of_threads(serve, monkeypatch):
    monkeypatch.setattr(metrics_http, "IDLE_SECONDS", DEADLINE)  # none times out meanwhile
    server = serve(tiny_model(), policy="async", host="127.0.0.1", metrics_port=0)
    port, http = server.metrics.port, server.metrics._http
    assert "paramserver_version" in _scrape(port)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
    try:
        wait_until(lambda: http.refused >= 64 - metrics_http.MAX_SCRAPES, "the rest refused")
        assert _serving_threads() <= metrics_http.MAX_SCRAPES
    finally:
        for s in idle:
            s.close()
    wait_until(lambda: _answers(port), "a scrape answered once they are gone")


def test_a_connection_that_sends_nothing_is_closed(serve, monkeypatch):
    monkeypatch.setattr(metrics_http, "IDLE_SECONDS", 0.5)
    server = serve(tiny_model(), policy="async", host="127.0.0.1", metrics_port=0)
    with socket.create_connection(("127.0.0.1", server.metrics.port)) as s:
        s.settimeout(DEADLINE)
        assert s.recv(1) == b""  # the server closed it
    assert "paramserver_version" in _scrape(server.metrics.port)


def _answers(port: int) -> bool:
    try:
        return "paramserver_version" in _scrape(port)
    except OSError:
        return False
