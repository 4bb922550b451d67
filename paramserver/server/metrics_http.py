"""The HTTP server of ``--metrics-port``: prometheus_client's, with what a peer may hold
bounded. Its own (``start_http_server``) gives every connection a thread for as long as the
peer keeps it open, so a peer on the metrics network that opened connections and sent
nothing held a thread (and its stack) each, as many as it liked. Here:

- a peer (an IP address) is served on at most ``PER_PEER`` connections at once, and all
  peers on at most ``MAX_SCRAPES``; one more is closed at once, unread. So one peer cannot
  keep Prometheus (another address) from scraping;
- a connection is closed ``DEADLINE_SECONDS`` after it came in, however slowly it sends,
  and after ``IDLE_SECONDS`` of silence.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import socketserver
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

MAX_SCRAPES = 16  # connections served at once, all peers together
PER_PEER = 2  # connections served at once from one address
IDLE_SECONDS = 5.0  # a connection silent this long is closed
DEADLINE_SECONDS = 10.0  # and any connection this long after it came in


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """Scrapes are not logged (a line each would flood the server's log)."""


class BoundedServer(socketserver.ThreadingMixIn, WSGIServer):
    """A thread a connection, within ``PER_PEER`` and ``MAX_SCRAPES``, each connection
    closed when idle or past its deadline."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._served: collections.Counter[str] = collections.Counter()
        self.refused = 0

    def _admit(self, peer: str) -> bool:
        with self._lock:
            if sum(self._served.values()) >= MAX_SCRAPES or self._served[peer] >= PER_PEER:
                self.refused += 1
                return False
            self._served[peer] += 1
            return True

    def _done(self, peer: str) -> None:
        with self._lock:
            self._served[peer] -= 1
            if self._served[peer] <= 0:
                del self._served[peer]

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = str(client_address[0])
        if not self._admit(peer):
            self.shutdown_request(request)
            return
        try:
            request.settimeout(IDLE_SECONDS)
            super().process_request(request, client_address)  # its thread
        except BaseException:
            self._done(peer)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        cut = threading.Timer(DEADLINE_SECONDS, _shut, (request,))
        cut.daemon = True
        cut.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()
            self._done(str(client_address[0]))

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer gone, idle or past its deadline: nothing to report."""


def _shut(request: socket.socket) -> None:
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)  # its handler's read ends


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
