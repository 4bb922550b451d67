"""The layout of a model's parameters as ONE flat float32 buffer, and its shards.

A Manifest (name, shape, dtype, byte offset of each tensor) is agreed at Join. Shard I of S
holds the contiguous elements ``shard_range(numel, I, S)``; tensors may straddle shards. A
worker copies between its tensors and any range of the flat buffer with ``flatten_into`` and
``unflatten_into``: one copy per element, whatever the number of shards.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.errors import ConfigError

# The only dtype the server-side optimizer keeps today; the manifest carries the name so
# that the format can grow without a wire change.
SUPPORTED_DTYPES = {"float32": np.float32}


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


def _pieces(
    manifest: Manifest, tensors: Sequence[torch.Tensor], lo: int, hi: int | None
) -> Iterator[tuple[torch.Tensor, int, int, int, bool]]:
    """For each tensor that overlaps elements [lo, hi) of the flat buffer: the tensor, the
    span [a, b) of its elements inside, where that span starts in a buffer of the range,
    and whether it is the whole tensor."""
    hi = manifest.numel if hi is None else hi
    for spec, t in zip(manifest.tensors, tensors, strict=True):
        start = spec.offset // 4
        a, b = max(start, lo) - start, min(start + spec.numel, hi) - start
        if a < b:
            yield t, a, b, start + a - lo, b - a == spec.numel


def flatten_into(
    manifest: Manifest,
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    lo: int = 0,
    hi: int | None = None,
) -> None:
    """Copy elements [lo, hi) of the flat buffer, taken from ``tensors`` (in manifest
    order), into the float32 buffer ``flat`` of hi - lo elements. One copy per element."""
    for t, a, b, at, _ in _pieces(manifest, tensors, lo, hi):
        flat[at : at + b - a].copy_(t.detach().reshape(-1)[a:b], non_blocking=True)


def unflatten_into(
    manifest: Manifest,
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    lo: int = 0,
    hi: int | None = None,
) -> None:
    """Copy the float32 buffer ``flat``, elements [lo, hi) of the flat buffer, into the
    parts of ``tensors`` (in manifest order) it covers, in place."""
    with torch.no_grad():
        for t, a, b, at, whole in _pieces(manifest, tensors, lo, hi):
            src = flat[at : at + b - a]
            if whole:
                t.copy_(src.view(t.shape), non_blocking=True)
            elif t.is_contiguous():
                t.view(-1)[a:b].copy_(src, non_blocking=True)
            else:  # a strided tensor straddling a shard boundary: rare, so not fast
                part = t.reshape(-1).clone()
                part[a:b].copy_(src)
                t.copy_(part.view(t.shape))


def state_dict(manifest: Manifest, flat: np.ndarray) -> dict[str, torch.Tensor]:
    """The flat buffer as a ``{name: tensor}`` dict that loads with ``model.load_state_dict``."""
    return {
        s.name: torch.from_numpy(flat[s.offset // 4 : s.offset // 4 + s.numel].copy()).view(s.shape)
        for s in manifest.tensors
    }
