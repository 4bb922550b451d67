"""Framing of payloads on gRPC streams: a header message, then raw data chunks.

A payload is a header message followed by data chunks of about ``chunk_bytes`` each; a
receiver writes the chunks straight into a buffer allocated once for the whole payload.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec.compression import by_dtype
from paramserver.errors import InvalidRequest

DEFAULT_CHUNK_BYTES = 1 << 20


def iter_chunks(payload: memoryview, chunk_bytes: int) -> Iterator[memoryview]:
    """Split a payload into zero-copy views of at most ``chunk_bytes``."""
    for start in range(0, len(payload), chunk_bytes):
        yield payload[start : start + chunk_bytes]


# --- the data chunks' fast path ---------------------------------------------------------
#
# A data chunk of PushChunk or PullChunk is field 2 (bytes) of its oneof: on the wire the tag
# byte 0x12, the length as a varint, then the bytes. Building and parsing protobuf objects for
# megabytes of payload costs several copies (measured: 108 ms to encode and 69 ms to decode
# 64 MiB in 1 MiB chunks); writing and reading that framing directly costs one copy each way.
# The bytes on the wire are exactly the protobuf encoding, so any protobuf peer interoperates.

_DATA_TAG = 0x12


class DataChunk:
    """A data chunk that refers to its bytes instead of copying them (duck-types PushChunk)."""

    __slots__ = ("data",)

    def __init__(self, data: memoryview):
        self.data = data

    @staticmethod
    def WhichOneof(_group: str) -> str:  # noqa: N802 - the protobuf message API
        return "data"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def serialize_chunk(msg: Any) -> bytes:
    """Wire bytes of a PushChunk, PullChunk or DataChunk (a DataChunk in one copy)."""
    if isinstance(msg, DataChunk):
        return b"".join((bytes((_DATA_TAG,)), _varint(len(msg.data)), msg.data))
    return msg.SerializeToString()


def _parser(message: type[pb.PushChunk] | type[pb.PullChunk]) -> Any:
    def parse(wire: bytes) -> Any:
        if wire[:1] == b"\x12":
            length, shift, i = 0, 0, 1
            while i < len(wire) and i <= 10:
                byte = wire[i]
                length |= (byte & 0x7F) << shift
                shift += 7
                i += 1
                if not byte & 0x80:
                    if i + length == len(wire):
                        return DataChunk(memoryview(wire)[i:])
                    break
        return message.FromString(wire)  # anything else: the general decoder

    return parse


parse_push_chunk = _parser(pb.PushChunk)
parse_pull_chunk = _parser(pb.PullChunk)


class Assembler:
    """Writes incoming chunks into one preallocated buffer of a known size (float32,
    float64, or ``itemsize``-byte elements kept as raw 16-bit words for a compressed
    payload)."""

    def __init__(
        self, total_bytes: int, out: np.ndarray | None = None, itemsize: int | None = None
    ):
        """``itemsize`` defaults to that of ``out``, or 4 (float32)."""
        itemsize = itemsize or (4 if out is None else out.itemsize)
        if total_bytes % itemsize:
            raise InvalidRequest(
                f"A payload of {total_bytes} bytes is not a whole number of {itemsize}-byte values."
            )
        kind = {1: np.uint8, 2: np.uint16, 4: np.float32, 8: np.float64}[itemsize]
        self.total_bytes = total_bytes
        self.array = np.empty(total_bytes // itemsize, kind) if out is None else out
        if self.array.dtype != kind or self.array.nbytes != total_bytes:
            raise InvalidRequest(
                f"The receive buffer holds {self.array.nbytes} bytes of {self.array.dtype}, not "
                f"{total_bytes} bytes of {np.dtype(kind).name}."
            )
        self._bytes = self.array.view(np.uint8)
        self.received = 0

    def add(self, data: bytes | memoryview) -> None:
        end = self.received + len(data)
        if end > self.total_bytes:
            raise InvalidRequest(
                f"The stream carried more than the {self.total_bytes} bytes its header announced."
            )
        self._bytes[self.received : end] = np.frombuffer(data, np.uint8)
        self.received = end

    def finish(self) -> np.ndarray:
        if self.received != self.total_bytes:
            raise InvalidRequest(
                f"The stream ended after {self.received} of the {self.total_bytes} bytes its "
                "header announced."
            )
        return self.array


# --- framing of pushes and pulls -------------------------------------------------------


def _encode(
    chunk: type[pb.PushChunk] | type[pb.PullChunk],
    header: pb.PushHeader | pb.PullHeader,
    payload: memoryview,
    chunk_bytes: int,
) -> Iterator[Any]:
    header.total_bytes = len(payload)
    yield chunk(header=header)
    for data in iter_chunks(payload, chunk_bytes):
        yield DataChunk(data)


def _first_header(stream: Iterator[Any], what: str) -> Any:
    first = next(stream, None)
    if first is None or first.WhichOneof("kind") != "header":
        raise InvalidRequest(f"A {what} stream must start with a header message.")
    return first.header


def encode_push(
    header: pb.PushHeader,
    payload: memoryview,
    chunk_bytes: int,
    rows: Sequence[pb.RowGradients] = (),
) -> Iterator[pb.PushChunk]:
    """A push stream: the header, its ``header.row_chunks`` row chunks (``rows``), then the
    payload in chunks."""
    stream = _encode(pb.PushChunk, header, payload, chunk_bytes)
    yield next(stream)
    for msg in rows:
        yield pb.PushChunk(rows=msg)
    yield from stream


def encode_pull(
    header: pb.PullHeader, payload: memoryview, chunk_bytes: int
) -> Iterator[pb.PullChunk]:
    """A pull stream: the header, then the weights in chunks."""
    return _encode(pb.PullChunk, header, payload, chunk_bytes)


def decode_push_header(stream: Iterator[pb.PushChunk]) -> pb.PushHeader:
    """The header of a push stream: its first message."""
    return _first_header(stream, "push")


def decode_push_rows(
    header: pb.PushHeader, stream: Iterator[pb.PushChunk]
) -> list[pb.RowGradients]:
    """The ``header.row_chunks`` row chunks that follow a push's header."""
    rows = []
    for i in range(header.row_chunks):
        msg = next(stream, None)
        if msg is None or msg.WhichOneof("kind") != "rows":
            got = "its end" if msg is None else f"a {msg.WhichOneof('kind')} chunk"
            raise InvalidRequest(
                f"A push announced {header.row_chunks} row chunks after its "
                f"header; chunk {i + 1} is {got}."
            )
        rows.append(msg.rows)
    return rows


def decode_payload(
    stream: Iterable[pb.PushChunk | pb.PullChunk], assembler: Assembler
) -> np.ndarray:
    """Read the data chunks that follow a header into ``assembler``."""
    for msg in stream:
        if msg.WhichOneof("kind") != "data":
            raise InvalidRequest(
                "Only data chunks may follow the header (and the row chunks "
                "it announces) of a stream."
            )
        assembler.add(msg.data)
    return assembler.finish()


def decode_gradient(
    stream: Iterable[pb.PushChunk],
    total_bytes: int,
    dtype: str,
    exact: int = 0,
    flat: str = "float32",
) -> np.ndarray:
    """Read a push's data chunks (``dtype`` elements, the last ``exact`` in ``flat``) into a
    new gradient of ``flat`` elements."""
    raw = decode_payload(stream, Assembler(total_bytes, itemsize=1))
    return by_dtype(dtype).decode(raw, exact, flat)


def expect_end(stream: Iterable[Any], what: str = "An empty push") -> None:
    """A stream that is its header alone (an empty push; a payload in shared memory)."""
    for _ in stream:
        raise InvalidRequest(f"{what} carries no data chunks.")


def decode_pull(
    stream: Iterator[pb.PullChunk],
    out: np.ndarray | None,
    total_bytes: int,
    itemsize: int | None = None,
) -> tuple[pb.PullHeader, np.ndarray]:
    """Read a pull stream into ``out`` (or a new buffer of ``itemsize``-byte floats, float32
    by default); returns its header and the weights."""
    header: pb.PullHeader = _first_header(stream, "pull")
    if header.shm:  # the weights are already in the worker's shared segment (``out``)
        expect_end(stream, "A pull answered through shared memory")
        if out is None:
            raise InvalidRequest("The server answered through shared memory to an observer.")
        return header, out
    if header.total_bytes != total_bytes:
        raise InvalidRequest(
            f"The server sent {header.total_bytes} bytes of weights; the manifest has "
            f"{total_bytes}."
        )
    return header, decode_payload(stream, Assembler(total_bytes, out, itemsize))
