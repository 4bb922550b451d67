"""Records of the socket paths: length-prefixed frames on the same-host Unix socket
(``server/doors/doorbell.py``) and on the data port other hosts use (``server/doors/dataport.py``).

A frame is a 24-byte header, then ``length`` payload bytes, then ``bulk`` bytes::

    <I length  <i status code (0: OK, else a grpc.StatusCode's number)  <d seconds  <Q bulk

The payload is a protobuf message (a request or an answer, at most ``MAX_PAYLOAD`` bytes);
the bulk is a step's raw tensor bytes (a push's gradient, a pull's weights), on the data
port only: the receiver checks ``bulk`` against what the payload says before it reads a
byte of it, and reads it straight into its own buffer (``recv_bulk``).

A worker sends ``PushPullRequest`` bytes with ``seconds`` its deadline; the server answers
``PushPullResponse`` bytes with code 0, or a failure's UTF-8 details with its status code,
which the worker raises as ``ControlError``, a ``grpc.RpcError``: the session retries and
translates it exactly as it does a gRPC call's. The first frame of a connection is the hello:
the segment's nonce, then the worker id in UTF-8; the server answers an empty frame with
code 0, or refuses: one failure frame (a malformed or late hello, another user, too many
connections waiting), then it closes the connection.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from paramserver.errors import InvalidRequest

HEADER = struct.Struct("<IidQ")
MAX_PAYLOAD = 1 << 20  # the message; tensors travel as bulk, or through the segment
OK = 0
NONCE_BYTES = 16  # a data-port nonce, issued at Join
_TOKEN_LENGTH = struct.Struct("<H")
_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class Frame:
    payload: bytes
    code: int = OK
    seconds: float = 0.0
    bulk: int = 0  # bytes that follow the payload


class ControlError(grpc.RpcError):
    """A failure the server answered on the control socket, as a gRPC call's would be."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def number(code: grpc.StatusCode) -> int:
    return int(code.value[0])


def encode(frame: Frame) -> bytes:
    """The header and payload (the bulk, if any, follows them)."""
    return HEADER.pack(len(frame.payload), frame.code, frame.seconds, frame.bulk) + frame.payload


# What follows a frame: none, one buffer, or several sent one after the other.
Bulk = memoryview | list[memoryview] | None


def bulk_bytes(bulk: Bulk) -> int:
    if bulk is None:
        return 0
    return bulk.nbytes if isinstance(bulk, memoryview) else sum(b.nbytes for b in bulk)


def send(sock: socket.socket, frame: Frame, bulk: Bulk = None) -> None:
    """Send ``frame``, then ``bulk`` (``frame.bulk`` bytes of it) without a copy."""
    if frame.bulk != bulk_bytes(bulk):
        raise ValueError(f"a frame announcing {frame.bulk} bulk bytes sent with other bulk")
    sock.sendall(encode(frame))
    for part in [bulk] if isinstance(bulk, memoryview) else bulk or []:
        if part.nbytes:
            sock.sendall(part.cast("B"))


def recv(
    sock: socket.socket, limit: int = MAX_PAYLOAD, deadline: float | None = None
) -> Frame | None:
    """The next frame, or None if the peer closed between frames.

    Args:
        limit: the longest payload accepted (the payload is not read past it).
        deadline: a ``time.monotonic()`` by which the whole frame must have arrived (the
            socket's timeout is set to what is left before each read); None: the socket's.

    Raises:
        ConnectionError: the peer closed inside a frame.
        TimeoutError: the frame was not all there by ``deadline`` (or the socket's timeout).
        InvalidRequest: a frame longer than ``limit`` (the stream is unusable after it).
    """
    head = _exactly(sock, HEADER.size, deadline, at_start=True)
    if head is None:
        return None
    length, code, seconds, bulk = HEADER.unpack(head)
    if length > limit:
        raise InvalidRequest(f"A control frame of {length} bytes; at most {limit}.")
    payload = _exactly(sock, length, deadline) if length else b""
    return Frame(payload or b"", code, seconds, bulk)


# A bulk is handed to its scan this much at a time (whole elements of any dtype).
SCAN_BYTES = 1 << 20


def recv_bulk(
    sock: socket.socket,
    out: memoryview,
    deadline: float | None = None,
    scan: Callable[[memoryview], None] | None = None,
) -> None:
    """Read a frame's bulk into ``out``, all of it (``len(out)`` bytes, checked beforehand
    against the frame's ``bulk``), handing ``scan`` (if any) every ``SCAN_BYTES`` as they
    arrive, while they are in cache, then the rest. Raises as ``recv`` does."""
    _read_into(sock, out.cast("B"), deadline, scan=scan)


def data_hello(token: str | None, nonce: bytes, worker_id: str) -> bytes:
    """The first frame's payload on the data port: the token's length and the token (empty
    without one), the nonce the Join answered, then the worker id in UTF-8."""
    raw = (token or "").encode()
    return _TOKEN_LENGTH.pack(len(raw)) + raw + nonce + worker_id.encode()


def parse_data_hello(payload: bytes) -> tuple[bytes, bytes, str]:
    """(token, nonce, worker id) of a data-port hello.

    Raises:
        InvalidRequest: it is not one.
    """
    size = _TOKEN_LENGTH.size
    n = _TOKEN_LENGTH.unpack_from(payload)[0] if len(payload) >= size else len(payload)
    rest = payload[size + n :]
    if len(payload) < size + n or len(rest) <= NONCE_BYTES:
        raise InvalidRequest(
            f"A hello of {len(payload)} bytes: a token's length and the token, a "
            f"{NONCE_BYTES}-byte nonce, then the worker id."
        )
    try:
        worker_id = rest[NONCE_BYTES:].decode()
    except UnicodeDecodeError:
        raise InvalidRequest("A hello whose worker id is not UTF-8.") from None
    return payload[size : size + n], rest[:NONCE_BYTES], worker_id


def failure(code: grpc.StatusCode, details: str) -> Frame:
    """A reply that fails with ``code`` (the worker raises it as ``ControlError``)."""
    return Frame(details.encode("utf-8", "replace"), number(code))


def raise_for(frame: Frame) -> bytes:
    """A reply's payload, or its failure raised as ``ControlError``."""
    if frame.code == OK:
        return frame.payload
    code = _CODES.get(frame.code, grpc.StatusCode.UNKNOWN)
    raise ControlError(code, frame.payload.decode("utf-8", "replace"))


def _exactly(
    sock: socket.socket, n: int, deadline: float | None, at_start: bool = False
) -> bytes | None:
    buf = bytearray(n)
    if _read_into(sock, memoryview(buf), deadline, at_start) == 0 and n:
        return None
    return bytes(buf)


def _read_into(
    sock: socket.socket,
    view: memoryview,
    deadline: float | None,
    at_start: bool = False,
    scan: Callable[[memoryview], None] | None = None,
) -> int:
    """Fill ``view``; 0 if the peer closed before its first byte and ``at_start``. ``scan``:
    see ``recv_bulk``."""
    n, got, scanned = view.nbytes, 0, 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"a control frame incomplete at its deadline ({got}/{n})")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if at_start and got == 0:
                return 0
            raise ConnectionError(f"the peer closed the socket inside a frame ({got}/{n})")
        got += k
        if scan is not None and (got == n or got - scanned >= SCAN_BYTES):
            upto = n if got == n else scanned + (got - scanned) // SCAN_BYTES * SCAN_BYTES
            scan(view[scanned:upto])
            scanned = upto
    return got
