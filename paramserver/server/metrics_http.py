"""The HTTP server of ``--metrics-port``: prometheus_client's, with what one peer may hold
bounded. Its own (``start_http_server``) gives every connection a thread for as long as the
peer keeps it open, so a peer on the metrics network that opens connections and sends
nothing held a thread (and its stack) each, as many as it liked. Here at most
``MAX_SCRAPES`` connections are served at once (one more is closed at once, unread), and a
connection that sends nothing for ``IDLE_SECONDS`` is closed. Prometheus scrapes one at a
time and retries the next interval.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

MAX_SCRAPES = 8  # connections served at once
IDLE_SECONDS = 5.0  # a connection silent this long is closed


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """Scrapes are not logged (a line each would flood the server's log)."""


class BoundedServer(socketserver.ThreadingMixIn, WSGIServer):
    """A thread a connection, at most ``MAX_SCRAPES`` at once, each closed when idle."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slots = threading.BoundedSemaphore(MAX_SCRAPES)
        self.refused = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            request.settimeout(IDLE_SECONDS)
            super().process_request(request, client_address)  # its thread
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer gone or idle past its time: nothing to report."""


def serve(host: str, port: int, registry: CollectorRegistry) -> BoundedServer:
    """``registry`` on http://host:port/metrics (port 0: any free one), served from a
    daemon thread.

    Raises:
        OSError: the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("MetricsServer", (BoundedServer,), {"address_family": family})
    httpd: BoundedServer = make_server(
        host.strip("[]"), port, make_wsgi_app(registry), server_class, handler_class=_Quiet
    )
    threading.Thread(target=httpd.serve_forever, name="ps-metrics-http", daemon=True).start()
    return httpd
