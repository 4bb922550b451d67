"""The control records of the same-host path: frames survive the socket, a peer's close is
told apart between and inside frames, and a failure comes back as the gRPC status it was."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from paramserver.codec import records
from paramserver.errors import InvalidRequest, UnknownWorker, WrongIncarnation, from_rpc_error


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_frames_round_trip_in_order(pair):
    a, b = pair
    frames = [
        records.Frame(b"x" * n, code, seconds)
        for n, code, seconds in [(0, 0, 0.0), (1, 5, 1.5), (70_000, 10, 60.0)]
    ]
    for f in frames:
        records.send(a, f)
    assert [records.recv(b) for _ in frames] == frames


def test_a_close_between_frames_is_the_end_and_inside_one_an_error(pair):
    a, b = pair
    records.send(a, records.Frame(b"one"))
    a.sendall(records.HEADER.pack(10, 0, 0.0, 0) + b"half")
    a.shutdown(socket.SHUT_WR)
    assert records.recv(b) == records.Frame(b"one")
    with pytest.raises(ConnectionError, match="inside a frame"):
        records.recv(b)
    c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    c.close()
    assert records.recv(d) is None
    d.close()


def test_an_oversized_frame_is_refused_before_its_payload_is_read(pair):
    a, b = pair
    a.sendall(records.HEADER.pack(records.MAX_PAYLOAD + 1, 0, 0.0, 0))
    with pytest.raises(InvalidRequest, match="control frame"):
        records.recv(b)


def test_a_frame_over_the_callers_limit_is_refused_unread(pair):
    a, b = pair
    a.sendall(records.HEADER.pack(65, 0, 0.0, 0) + b"x" * 65)
    with pytest.raises(InvalidRequest, match="65 bytes; at most 64"):
        records.recv(b, limit=64)


def test_a_frame_that_is_not_all_there_by_the_deadline_times_out(pair):
    """A peer that sends a hello a byte at a time cannot stretch the deadline: it bounds
    the whole frame, not each read (time.monotonic is the clock; the deadline is past)."""
    a, b = pair
    a.sendall(records.HEADER.pack(10, 0, 0.0, 0) + b"abc")
    with pytest.raises(TimeoutError):
        records.recv(b, deadline=time.monotonic() - 1.0)
    c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises(TimeoutError):  # nothing at all: silent
            records.recv(d, deadline=time.monotonic() + 0.01)
    finally:
        c.close()
        d.close()


@pytest.mark.parametrize(
    ("code", "cls"),
    [(grpc.StatusCode.NOT_FOUND, UnknownWorker), (grpc.StatusCode.ABORTED, WrongIncarnation)],
)
def test_a_failure_is_raised_as_the_rpc_error_it_was(code, cls):
    frame = records.Frame(b"why it failed", records.number(code))
    with pytest.raises(grpc.RpcError) as err:
        records.raise_for(frame)
    assert err.value.code() == code and err.value.details() == "why it failed"
    assert isinstance(from_rpc_error(err.value, "push"), cls)
    assert records.raise_for(records.Frame(b"payload")) == b"payload"


def test_a_bulk_is_scanned_in_whole_pieces_as_it_arrives():
    """The scan sees every byte once, in order, in pieces of SCAN_BYTES but the last, however
    the socket cuts the stream."""
    payload = bytes(range(256)) * (3 * records.SCAN_BYTES // 256 + 7)
    left, right = socket.socketpair()
    pieces: list[bytes] = []
    try:
        sender = threading.Thread(target=left.sendall, args=(payload,))
        sender.start()
        out = bytearray(len(payload))
        records.recv_bulk(right, memoryview(out), scan=lambda piece: pieces.append(bytes(piece)))
        sender.join()
    finally:
        left.close()
        right.close()
    assert bytes(out) == payload and b"".join(pieces) == payload
    assert all(len(p) % records.SCAN_BYTES == 0 for p in pieces[:-1])
