"""TLS credentials and the shared token, for servers and clients.

The token travels as ``authorization: Bearer <token>`` metadata on every call; the server's
interceptor refuses a call without it (UNAUTHENTICATED) before any servicer code runs, and
before its request is read: the refusal takes the request as a stream it never reads, and
runs on the health service's side pool (``transport/health.py``), not the workers' threads.
The data port (``server/doors/dataport.py``, ``transport/tcp.py``) carries the same: TLS from the
same files (``server_ssl_context``, ``client_ssl_context``), the token in its hello
(``token_matches``).
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Callable
from typing import Any

import grpc

from paramserver.config import Security
from paramserver.errors import Unauthenticated, to_status
from paramserver.transport.handlers import method_handler

METADATA_KEY = "authorization"
HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _bearer(token: str) -> str:
    return f"Bearer {token}"


NO_TOKEN = (
    "This server requires a token and the call carried none: start the client with --token "
    "or PARAMSERVER_TOKEN set to the server's."
)
WRONG_TOKEN = (
    "The token the call carried does not match this server's: start the client with --token "
    "or PARAMSERVER_TOKEN set to the server's."
)


def refusal(got: bytes) -> str:
    """Why a call carrying ``got`` (empty: none) as its token is refused, without saying
    what the token is."""
    return WRONG_TOKEN if got else NO_TOKEN


def token_matches(expected: str | None, got: bytes) -> bool:
    """Whether ``got`` is the token ``expected`` (anything, where no token is set), in
    constant time."""
    return expected is None or hmac.compare_digest(expected.encode(), got)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call that does not carry the shared token."""

    def __init__(self, token: str):
        self._expected = _bearer(token).encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if details.method.startswith(HEALTH_PREFIX):
            return handler  # health says only SERVING or not; probes carry no secrets
        got = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        got_bytes = got.encode() if isinstance(got, str) else bytes(got)
        if handler is None or hmac.compare_digest(got_bytes, self._expected):
            return handler
        return _refusing(handler, refusal(got_bytes))


def _deny(requests: Any, context: grpc.ServicerContext, why: str) -> Any:
    """Refuses at once: ``requests`` (a stream, whatever the method) is never read."""
    context.abort(*to_status(Unauthenticated(why)))


def _refusing(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler that aborts with UNAUTHENTICATED without reading the request: on the
    wire a unary request is a stream of one message, so a stream handler answers any
    method, and its body stays unread (beyond gRPC's flow-control window)."""
    from paramserver.transport.health import on_side_pool

    return method_handler(
        on_side_pool(lambda requests, context: _deny(requests, context, why)),
        request_streaming=True,  # the request as a stream, never read
        response_streaming=bool(handler.response_streaming),
        request_deserializer=None,
        response_serializer=handler.response_serializer,
    )


def server_interceptors(security: Security) -> list[grpc.ServerInterceptor]:
    return [TokenInterceptor(security.token)] if security.token else []


def server_credentials(security: Security) -> grpc.ServerCredentials | None:
    """TLS credentials for the server's port; None for plain text."""
    if not security.cert:
        return None
    ca = security.read("ca")
    return grpc.ssl_server_credentials(
        [(security.read("key"), security.read("cert"))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


class _ClientToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call of a channel."""

    def __init__(self, token: str):
        self._entry = (METADATA_KEY, _bearer(token))

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self._entry]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):  # type: ignore[no-untyped-def]
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def client_channel(
    address: str, security: Security, options: list[tuple[str, Any]]
) -> grpc.Channel:
    """A channel to ``address`` with the TLS and token of ``security``."""
    if security.tls:
        creds = grpc.ssl_channel_credentials(
            root_certificates=security.read("ca"),
            private_key=security.read("key"),
            certificate_chain=security.read("cert"),
        )
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if security.token:
        channel = grpc.intercept_channel(channel, _ClientToken(security.token))
    return channel


def server_ssl_context(security: Security) -> ssl.SSLContext | None:
    """The TLS of ``server_credentials`` for a plain socket (the data port); None for plain
    text. With a CA, a client must present a certificate it signed."""
    if not security.cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(security.cert, security.key)
    if security.ca:
        ctx.load_verify_locations(security.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(security: Security) -> ssl.SSLContext | None:
    """The TLS of ``client_channel`` for a plain socket: the server verified by ``ca`` (the
    system's roots without one) and its host name, the client certificate if given; None
    for plain text."""
    if not security.tls:
        return None
    ctx = ssl.create_default_context(cafile=security.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if security.cert:
        ctx.load_cert_chain(security.cert, security.key)
    return ctx
