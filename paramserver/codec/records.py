"""Control records of the same-host path: length-prefixed frames on a Unix socket.

A frame is a 16-byte header, then ``length`` payload bytes::

    <I length  <i status code (0: OK, else a grpc.StatusCode's number)  <d seconds

A worker sends ``PushPullRequest`` bytes with ``seconds`` its deadline; the server answers
``PushPullResponse`` bytes with code 0, or a failure's UTF-8 details with its status code,
which the worker raises as ``ControlError``, a ``grpc.RpcError``: the session retries and
translates it exactly as it does a gRPC call's. The first frame of a connection is the hello:
the segment's nonce, then the worker id.
"""

from __future__ import annotations

import socket
import struct
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


def send(sock: socket.socket, frame: Frame) -> None:
    sock.sendall(HEADER.pack(len(frame.payload), frame.code, frame.seconds) + frame.payload)


def recv(sock: socket.socket) -> Frame | None:
    """The next frame, or None if the peer closed between frames.

    Raises:
        ConnectionError: the peer closed inside a frame.
        InvalidRequest: a frame longer than MAX_PAYLOAD (the stream is unusable after it).
    """
    head = _exactly(sock, HEADER.size, at_start=True)
    if head is None:
        return None
    length, code, seconds = HEADER.unpack(head)
    if length > MAX_PAYLOAD:
        raise InvalidRequest(f"A control frame of {length} bytes; at most {MAX_PAYLOAD}.")
    payload = _exactly(sock, length) if length else b""
    return Frame(payload or b"", code, seconds)


def raise_for(frame: Frame) -> bytes:
    """A reply's payload, or its failure raised as ``ControlError``."""
    if frame.code == OK:
        return frame.payload
    code = _CODES.get(frame.code, grpc.StatusCode.UNKNOWN)
    raise ControlError(code, frame.payload.decode("utf-8", "replace"))


def _exactly(sock: socket.socket, n: int, at_start: bool = False) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if at_start and got == 0:
                return None
            raise ConnectionError(f"the peer closed the control socket inside a frame ({got}/{n})")
        got += k
    return bytes(buf)
