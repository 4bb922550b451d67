"""The only code that turns tensors into bytes and back.

A model's parameters travel as ONE flat little-endian buffer, described by a Manifest
(name, shape, dtype, byte offset of each tensor) agreed at Join. On the wire a payload is a
header message followed by data chunks of about ``chunk_bytes`` each; a receiver writes the
chunks straight into a buffer allocated once for the whole payload.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.errors import ConfigError, InvalidRequest

DEFAULT_CHUNK_BYTES = 1 << 20
# The only dtype the server-side optimizer keeps today; the manifest carries the name so
# that the format can grow without a wire change.
SUPPORTED_DTYPES = {"float32": np.float32}
# What a streamed push may carry: float32, or a compressed gradient the server widens.
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# ``--compress`` names for them.
COMPRESSION = {"none": "float32", "fp16": "float16", "bf16": "bfloat16"}
FP16_MAX = 65504.0


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Manifest:
    """The layout of the flat buffer: every tensor's name, shape, dtype and offset."""

    tensors: tuple[TensorSpec, ...]
    total_bytes: int

    @classmethod
    def from_tensors(cls, named: Iterable[tuple[str, torch.Tensor]]) -> Manifest:
        """Lay out the tensors one after another, in the order given.

        Raises:
            ConfigError: a tensor has a dtype the server cannot hold.
        """
        specs = []
        offset = 0
        for name, t in named:
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in SUPPORTED_DTYPES:
                raise ConfigError(
                    f"Parameter {name!r} has dtype {dtype}; paramserver holds float32 "
                    "parameters only. Convert the model with model.float() first."
                )
            nbytes = t.numel() * t.element_size()
            specs.append(TensorSpec(name, tuple(t.shape), dtype, offset, nbytes))
            offset += nbytes
        return cls(tuple(specs), offset)

    @property
    def numel(self) -> int:
        """Elements in the flat buffer (all tensors are float32)."""
        return self.total_bytes // 4

    def to_proto(self) -> pb.Manifest:
        return pb.Manifest(
            tensors=[
                pb.TensorSpec(
                    name=s.name, shape=s.shape, dtype=s.dtype, offset=s.offset, nbytes=s.nbytes
                )
                for s in self.tensors
            ],
            total_bytes=self.total_bytes,
        )

    @classmethod
    def from_proto(cls, msg: pb.Manifest) -> Manifest:
        return cls(
            tuple(
                TensorSpec(t.name, tuple(t.shape), t.dtype, t.offset, t.nbytes) for t in msg.tensors
            ),
            msg.total_bytes,
        )

    def check_compatible(self, other: Manifest, what: str) -> None:
        """Raise ConfigError, naming the first difference, unless the layouts are equal."""
        if self == other:
            return
        mine = {s.name: s for s in self.tensors}
        theirs = {s.name: s for s in other.tensors}
        for name in [*mine, *(n for n in theirs if n not in mine)]:
            a, b = mine.get(name), theirs.get(name)
            if a is None or b is None:
                side = "the server" if a is None else what
                raise ConfigError(
                    f"Parameter {name!r} is missing from {side}: {what} does not match the "
                    "server's model."
                )
            if a != b:
                raise ConfigError(
                    f"Parameter {name!r} is {a.dtype}{list(a.shape)} on the server but "
                    f"{b.dtype}{list(b.shape)} in {what}."
                )
        raise ConfigError(f"The parameter order of {what} differs from the server's model.")


def shard_range(numel: int, shard: int, shards: int) -> tuple[int, int]:
    """The elements [lo, hi) of a flat buffer of ``numel`` that shard ``shard`` of
    ``shards`` holds: contiguous ranges of equal size (the last may be shorter); tensors
    may straddle shards."""
    size = -(-numel // shards)
    lo = min(shard * size, numel)
    return lo, min(lo + size, numel)


def shard_manifest(numel: int) -> Manifest:
    """The manifest a shard serves: its range as one flat tensor named ``flat``."""
    return Manifest((TensorSpec("flat", (numel,), "float32", 0, 4 * numel),), 4 * numel)


def flatten_into(manifest: Manifest, tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``tensors`` (in manifest order) into the float32 buffer ``flat``."""
    for spec, t in zip(manifest.tensors, tensors, strict=True):
        start = spec.offset // 4
        flat[start : start + spec.numel].copy_(t.detach().reshape(-1), non_blocking=True)


def unflatten_into(manifest: Manifest, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy the float32 buffer ``flat`` into ``tensors`` (in manifest order), in place."""
    with torch.no_grad():
        for spec, t in zip(manifest.tensors, tensors, strict=True):
            start = spec.offset // 4
            t.copy_(flat[start : start + spec.numel].view(t.shape), non_blocking=True)


def state_dict(manifest: Manifest, flat: np.ndarray) -> dict[str, torch.Tensor]:
    """The flat buffer as a ``{name: tensor}`` dict that loads with ``model.load_state_dict``."""
    return {
        s.name: torch.from_numpy(flat[s.offset // 4 : s.offset // 4 + s.numel].copy()).view(s.shape)
        for s in manifest.tensors
    }


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


def as_bytes(array: np.ndarray) -> memoryview:
    """A zero-copy byte view of a contiguous array."""
    return np.ascontiguousarray(array).view(np.uint8).data


def wire_dtype(name: str) -> str:
    """The element type a push header names ("" is float32).

    Raises:
        InvalidRequest: not one of ``WIRE_DTYPES``.
    """
    name = name or "float32"
    if name not in WIRE_DTYPES:
        raise InvalidRequest(
            f"Unknown payload dtype {name!r}: this server takes {', '.join(WIRE_DTYPES)}."
        )
    return name


def wire_itemsize(name: str) -> int:
    """Bytes per element of the wire dtype ``name``."""
    return WIRE_DTYPES[wire_dtype(name)].itemsize


class Compressor:
    """Casts float32 gradients to a smaller wire dtype, in a buffer reused from push to push.

    fp16 saturates values beyond its range (+-65504) instead of letting them become Inf,
    which the server would refuse; a gradient that holds NaN or Inf keeps them.
    """

    def __init__(self, dtype: str, numel: int):
        self.dtype = wire_dtype(dtype)
        self._buf = (
            None if self.dtype == "float32" else torch.empty(numel, dtype=WIRE_DTYPES[self.dtype])
        )

    def encode(self, flat: torch.Tensor) -> memoryview:
        """The wire bytes of the float32 CPU tensor ``flat`` (valid until the next call)."""
        if self._buf is None:
            return as_bytes(flat.numpy())
        self._buf.copy_(flat)
        if self.dtype == "float16" and bool(torch.isinf(self._buf).any()):
            saturated = flat.clamp(-FP16_MAX, FP16_MAX)
            self._buf.copy_(torch.where(torch.isfinite(flat), saturated, flat))
        return as_bytes(self._buf.view(torch.int16).numpy())


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """A received payload (raw bytes of ``dtype`` elements) as float32."""
    dtype = wire_dtype(dtype)
    if dtype == "float32":
        return raw.view(np.float32)
    return torch.from_numpy(raw.view(np.int16)).view(WIRE_DTYPES[dtype]).float().numpy()


class Assembler:
    """Writes incoming chunks into one preallocated buffer of a known size (float32, or
    ``itemsize``-byte elements kept as raw 16-bit words for a compressed payload)."""

    def __init__(self, total_bytes: int, out: np.ndarray | None = None, itemsize: int = 4):
        if total_bytes % itemsize:
            raise InvalidRequest(
                f"A payload of {total_bytes} bytes is not a whole number of {itemsize}-byte values."
            )
        kind = np.float32 if itemsize == 4 else np.uint16
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
    header: pb.PushHeader, payload: memoryview, chunk_bytes: int
) -> Iterator[pb.PushChunk]:
    """A push stream: the header, then the payload in chunks."""
    return _encode(pb.PushChunk, header, payload, chunk_bytes)


def encode_pull(
    header: pb.PullHeader, payload: memoryview, chunk_bytes: int
) -> Iterator[pb.PullChunk]:
    """A pull stream: the header, then the weights in chunks."""
    return _encode(pb.PullChunk, header, payload, chunk_bytes)


def decode_push_header(stream: Iterator[pb.PushChunk]) -> pb.PushHeader:
    """The header of a push stream: its first message."""
    return _first_header(stream, "push")


def decode_payload(
    stream: Iterable[pb.PushChunk | pb.PullChunk], assembler: Assembler
) -> np.ndarray:
    """Read the data chunks that follow a header into ``assembler``."""
    for msg in stream:
        if msg.WhichOneof("kind") != "data":
            raise InvalidRequest("Only data chunks may follow the header of a stream.")
        assembler.add(msg.data)
    return assembler.finish()


def decode_gradient(stream: Iterable[pb.PushChunk], total_bytes: int, dtype: str) -> np.ndarray:
    """Read a push's data chunks (``dtype`` elements) into a new float32 gradient."""
    assembler = Assembler(total_bytes, itemsize=wire_itemsize(dtype))
    return to_float32(decode_payload(stream, assembler), dtype)


def expect_end(stream: Iterable[Any], what: str = "An empty push") -> None:
    """A stream that is its header alone (an empty push; a payload in shared memory)."""
    for _ in stream:
        raise InvalidRequest(f"{what} carries no data chunks.")


def decode_pull(
    stream: Iterator[pb.PullChunk], out: np.ndarray | None, total_bytes: int
) -> tuple[pb.PullHeader, np.ndarray]:
    """Read a pull stream into ``out`` (or a new buffer); returns its header and the weights."""
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
    return header, decode_payload(stream, Assembler(total_bytes, out))
