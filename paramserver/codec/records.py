"""Control records of the same-host path: length-prefixed frames on a Unix socket.

A frame is a 16-byte header, then ``length`` payload bytes::

    <I length  <i status code (0: OK, else a grpc.StatusCode's number)  <d seconds

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
from dataclasses import dataclass

import grpc

from paramserver.errors import InvalidRequest

HEADER = struct.Struct("<Iid")
MAX_PAYLOAD = 1 << 20  # control only: the payloads travel through the segment
OK = 0
_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class Frame:
    payload: bytes
    code: int = OK
    seconds: float = 0.0


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
    return HEADER.pack(len(frame.payload), frame.code, frame.seconds) + frame.payload


def send(sock: socket.socket, frame: Frame) -> None:
    sock.sendall(encode(frame))


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
    length, code, seconds = HEADER.unpack(head)
    if length > limit:
        raise InvalidRequest(f"A control frame of {length} bytes; at most {limit}.")
    payload = _exactly(sock, length, deadline) if length else b""
    return Frame(payload or b"", code, seconds)


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
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"a control frame incomplete at its deadline ({got}/{n})")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if at_start and got == 0:
                return None
            raise ConnectionError(f"the peer closed the control socket inside a frame ({got}/{n})")
        got += k
    return bytes(buf)
