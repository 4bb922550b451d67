"""Binding the server's gRPC port, with a refusal in one sentence: a port in use is named as
such before gRPC tries it (gRPC would log a line of its own and answer with a hint to set
GRPC_VERBOSITY), and any other failure says what to check."""

from __future__ import annotations

import errno
import socket
from typing import Any

import grpc

from paramserver.errors import ConfigError


def bracketed(host: str) -> str:
    """An IPv6 host in brackets, as host:port needs it."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def refusal(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound here, found by binding it first (with
    SO_REUSEADDR, as gRPC does): in use, or an address this machine does not have; None
    when it can be (or it is port 0, or a host name: gRPC resolves those)."""
    address = host.strip("[]") or "0.0.0.0"
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        socket.inet_pton(family, address)
    except OSError:
        return None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE and port != 0:
                return (
                    "the port is in use (another server?). Pick another --port, or stop "
                    "what holds it."
                )
            if exc.errno == errno.EADDRNOTAVAIL:
                return "this machine has no such address (--host)."
            if exc.errno == errno.EACCES:
                return (
                    "permission denied: a port below 1024 needs root (or "
                    "CAP_NET_BIND_SERVICE); pick another --port."
                )
    return None


def bind_grpc(server: grpc.Server, host: str, port: int, creds: Any) -> int:
    """Add ``host:port`` to ``server`` (TLS with ``creds``, else insecure); the port bound.

    Raises:
        ConfigError: the port is in use, or the address cannot be bound here.
    """
    where = f"{bracketed(host)}:{port}"
    why = refusal(host, port)
    if why is not None:
        raise ConfigError(f"Cannot listen on {where}: {why}")
    try:
        if creds is None:
            bound = server.add_insecure_port(where)
        else:
            bound = server.add_secure_port(where, creds)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ConfigError(
            f"Cannot listen on {where}: the port is in use or the address is not on this "
            "machine (--host, --port)."
        )
    return int(bound)
