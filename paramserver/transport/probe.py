"""What listens at an address that gRPC cannot connect to: a client pointed at a server's
data port, its metrics port or a TLS port without --tls-ca is told so at once, instead of
waiting out its timeout for a channel that will never be ready.

``not_grpc`` opens a TCP connection and sends HTTP/2's client preface and an empty SETTINGS
frame. A gRPC server answers with its own SETTINGS frame; a paramserver data port with a
refusal in its own framing (``codec/records.py``); a TLS port with an alert record; an
HTTP/1 server with a status line. Only those definite answers count: nothing listening, a
silent peer or a closed connection say nothing (the caller keeps waiting, as before).
"""

from __future__ import annotations

import socket

from paramserver.codec import records

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4  # an HTTP/2 frame's type, its fourth byte
_GRPC_PORT = "give the server's gRPC port: the one its 'paramserver server listening on' line names"


def host_port(address: str) -> tuple[str, int] | None:
    """``("h", 1234)`` of ``h:1234`` or ``[::1]:1234``; None for any other form (``unix:``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or address.startswith("unix:"):
        return None
    return host.strip("[]") or "localhost", int(port)


def not_grpc(address: str, timeout: float = 2.0) -> str | None:
    """Why ``address`` is certainly not a gRPC port (None: it is, or nothing listens there
    yet, or its answer proves nothing)."""
    where = host_port(address)
    if where is None:
        return None
    try:
        sock = socket.create_connection(where, timeout)
    except (OSError, ValueError):
        return None  # nothing listens (yet): gRPC's own wait says so
    with sock:
        try:
            sock.sendall(PREFACE)
            got = sock.recv(64)
        except OSError:
            return None  # silent, or reset: nothing certain
    return what_answered(got)


def what_answered(got: bytes) -> str | None:
    """What a peer's first bytes after the preface say it is (None: gRPC, or unknown)."""
    if len(got) >= 9 and got[3] == _SETTINGS:
        return None  # HTTP/2: a gRPC server (a TLS or token mismatch shows on the call)
    if len(got) >= records.HEADER.size:
        length, code, _, bulk = records.HEADER.unpack_from(got)
        if 0 < length <= 4096 and 0 < code < 17 and bulk == 0:
            return (
                "it answers in the framing of a paramserver data port (workers find a "
                f"server's data port on their own); {_GRPC_PORT}"
            )
    if got[:1] in (b"\x15", b"\x16") and got[1:2] == b"\x03":
        return (
            "it speaks TLS: pass --tls-ca (and --tls-cert/--tls-key if the server asks for "
            "a client certificate)"
        )
    if got.startswith(b"HTTP/") or got.lstrip()[:9].lower() in (b"<!doctype", b"<html>"):
        first = got.split(b"\n", 1)[0].strip().decode("ascii", "replace")
        return f"it is an HTTP/1 server (it answered {first!r}: a metrics port?); {_GRPC_PORT}"
    if got:
        return f"it answered {got[:16]!r}, not HTTP/2; {_GRPC_PORT}"
    return None
