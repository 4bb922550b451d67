"""The layout of a model's state as ONE flat buffer (float32, or float64), and its shards.

A Manifest (name, shape, dtype, role, byte offset of each tensor) is agreed at Join. The
flat buffer holds float32 elements whatever the model's dtypes (float32 master weights for
float16 and bfloat16 models; integer buffers as exact integers up to 2**24), or float64
ones when a tensor is float64 (``Manifest.dtype``). Its tensors come
in three sections, in this order (``ROLES``): the trainable parameters, the floating-point
buffers, the integer buffers ("counts"). Shard I of S holds the contiguous elements
``shard_range(numel, I, S)``; tensors may straddle shards. A worker copies between its
tensors and any range of the flat buffer with ``flatten_into`` and ``unflatten_into``: one
copy per element, whatever the number of shards, converting dtypes on the way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.errors import ConfigError, InvalidRequest

# The flat buffer's element: float32 whatever the model tensor's dtype, or float64 when a
# tensor is float64 (master weights as wide as the widest parameter).
FLAT_DTYPES = {"float32": 4, "float64": 8}
# The sections of the flat buffer, in order: trained parameters, float buffers (mean over
# workers), integer buffers (largest value).
ROLES = ("param", "buffer", "count")
# What each role may hold.
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
COUNT_DTYPES = ("int64", "int32", "int16", "int8", "uint8")
DTYPES = {"param": FLOAT_DTYPES, "buffer": FLOAT_DTYPES, "count": COUNT_DTYPES}


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    role: str = "param"
    itemsize: int = 4  # of the flat buffer (the manifest's dtype), not of ``dtype``

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def start(self) -> int:
        """Its first element in the flat buffer."""
        return self.offset // self.itemsize


@dataclass(frozen=True)
class Manifest:
    """The layout of the flat buffer: every tensor's name, shape, dtype and offset."""

    tensors: tuple[TensorSpec, ...]
    total_bytes: int
    dtype: str = "float32"  # of the flat buffer's elements (``FLAT_DTYPES``)

    @classmethod
    def from_tensors(
        cls,
        named: Iterable[tuple[str, torch.Tensor]],
        roles: Sequence[str] | None = None,
        dtype: str | None = None,
    ) -> Manifest:
        """Lay out the tensors one after another, in the order given; ``roles`` (default:
        every one a "param") must come in ``ROLES`` order. The flat buffer's ``dtype`` is
        float64 if a tensor is, else float32, unless given.

        Raises:
            ConfigError: a tensor has a dtype its role cannot hold (the message names it).
        """
        specs: list[TensorSpec] = []
        offset = 0
        named = list(named)
        if dtype is None:
            wide = any(t.dtype == torch.float64 for _, t in named)
            dtype = "float64" if wide else "float32"
        itemsize = FLAT_DTYPES[dtype]
        for i, (name, t) in enumerate(named):
            role = "param" if roles is None else roles[i]
            kind = str(t.dtype).removeprefix("torch.")
            if kind not in DTYPES[role]:
                raise ConfigError(_dtype_refusal(name, kind, role))
            if specs and ROLES.index(role) < ROLES.index(specs[-1].role):
                raise ValueError(f"Tensor {name!r} ({role}) comes after a {specs[-1].role}.")
            nbytes = t.numel() * itemsize
            specs.append(TensorSpec(name, tuple(t.shape), kind, offset, nbytes, role, itemsize))
            offset += nbytes
        return cls(tuple(specs), offset, dtype)

    @property
    def itemsize(self) -> int:
        return FLAT_DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        """Elements in the flat buffer."""
        return self.total_bytes // self.itemsize

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def section(self, role: str) -> tuple[int, int]:
        """The elements [lo, hi) of the flat buffer that hold tensors of ``role``."""
        lo = hi = sum(s.numel for s in self.tensors if ROLES.index(s.role) < ROLES.index(role))
        hi += sum(s.numel for s in self.tensors if s.role == role)
        return lo, hi

    def exact_tail(self, lo: int, hi: int) -> int:
        """How many of the elements [lo, hi) are integer buffers (the last section), which a
        16-bit payload of that range carries exact."""
        counts = self.section("count")[0]
        return max(0, hi - max(lo, counts))

    def dense_tail(self, lo: int, hi: int) -> int:
        """How many of the elements [lo, hi) are buffers, float or integer (the last two
        sections): values, not gradients, which a sparse push sends whole."""
        buffers = self.section("buffer")[0]
        return max(0, hi - max(lo, buffers))

    def to_proto(self) -> pb.Manifest:
        return pb.Manifest(
            tensors=[
                pb.TensorSpec(
                    name=s.name,
                    shape=s.shape,
                    dtype=s.dtype,
                    offset=s.offset,
                    nbytes=s.nbytes,
                    role=s.role,
                )
                for s in self.tensors
            ],
            total_bytes=self.total_bytes,
            dtype=self.dtype,
        )

    @classmethod
    def from_proto(cls, msg: pb.Manifest) -> Manifest:
        """The manifest a peer sent.

        Raises:
            InvalidRequest: its flat dtype is not one of ``FLAT_DTYPES``.
        """
        dtype = msg.dtype or "float32"
        if dtype not in FLAT_DTYPES:
            raise InvalidRequest(f"Unknown flat buffer dtype {dtype!r}.")
        itemsize = FLAT_DTYPES[dtype]
        return cls(
            tuple(
                TensorSpec(
                    t.name, tuple(t.shape), t.dtype, t.offset, t.nbytes, t.role or "param", itemsize
                )
                for t in msg.tensors
            ),
            msg.total_bytes,
            dtype,
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


# The tensors a shard's manifest names, one per section of its range (None: the flat dtype).
SHARD_TENSORS = {"param": ("flat", None), "buffer": ("buffers", None), "count": ("counts", "int64")}


def shard_manifest(model: Manifest, lo: int, hi: int) -> Manifest:
    """The manifest a shard of elements [lo, hi) of ``model``'s flat buffer serves: the
    part of each section in its range as one flat tensor (``SHARD_TENSORS``)."""
    named: list[tuple[str, torch.Tensor]] = []
    roles: list[str] = []
    for role in ROLES:
        a, b = model.section(role)
        n = min(b, hi) - max(a, lo)
        if n > 0:
            name, dtype = SHARD_TENSORS[role]
            # a meta tensor: its shape and dtype, and no memory
            kind = getattr(torch, dtype or model.dtype)
            named.append((name, torch.empty(n, dtype=kind, device="meta")))
            roles.append(role)
    return Manifest.from_tensors(named, roles, model.dtype)


def _dtype_refusal(name: str, dtype: str, role: str) -> str:
    if role == "param":
        return (
            f"Parameter {name!r} has dtype {dtype}; paramserver trains {', '.join(FLOAT_DTYPES)} "
            "parameters. Convert the model (for example model.float()), or freeze the "
            "parameter (requires_grad=False)."
        )
    return (
        f"Buffer {name!r} has dtype {dtype}; paramserver keeps floating-point buffers of "
        f"{', '.join(FLOAT_DTYPES)} and integer buffers of {', '.join(COUNT_DTYPES)}. Convert "
        "it, or register it with persistent=False to keep it out of the run's state."
    )


def _pieces(
    manifest: Manifest, tensors: Sequence[torch.Tensor], lo: int, hi: int | None
) -> Iterator[tuple[torch.Tensor, int, int, int, bool]]:
    """For each tensor that overlaps elements [lo, hi) of the flat buffer: the tensor, the
    span [a, b) of its elements inside, where that span starts in a buffer of the range,
    and whether it is the whole tensor."""
    hi = manifest.numel if hi is None else hi
    for spec, t in zip(manifest.tensors, tensors, strict=True):
        start = spec.start
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
    order), into the buffer ``flat`` of hi - lo elements. One copy per element."""
    for t, a, b, at, _ in _pieces(manifest, tensors, lo, hi):
        flat[at : at + b - a].copy_(t.detach().reshape(-1)[a:b], non_blocking=True)


def spans(
    manifest: Manifest, tensors: Sequence[torch.Tensor], dtype: torch.dtype, lo: int, hi: int
) -> list[torch.Tensor] | None:
    """Elements [lo, hi) of the flat buffer as 1-D views of ``tensors`` (in manifest order),
    with no copy: what ``flatten_into`` would copy, in order. None unless each is a
    contiguous CPU tensor of ``dtype``."""
    out = []
    for t, a, b, _, _ in _pieces(manifest, tensors, lo, hi):
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            return None
        out.append(t.detach().view(-1)[a:b])
    return out


def unflatten_into(
    manifest: Manifest,
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    lo: int = 0,
    hi: int | None = None,
) -> None:
    """Copy the buffer ``flat``, elements [lo, hi) of the flat buffer, into the
    parts of ``tensors`` (in manifest order) it covers, in place."""
    with torch.no_grad():
        for t, a, b, at, whole in _pieces(manifest, tensors, lo, hi):
            src = flat[at : at + b - a]
            if whole and t.data_ptr() == src.data_ptr() and t.device == src.device:
                continue  # the tensor is a view of the buffer (``views_of``): in place already
            if whole:
                t.copy_(src.view(t.shape), non_blocking=True)
            elif t.is_contiguous():
                t.view(-1)[a:b].copy_(src, non_blocking=True)
            else:  # a strided tensor straddling a shard boundary: rare, so not fast
                part = t.reshape(-1).clone()
                part[a:b].copy_(src)
                t.copy_(part.view(t.shape))


def views_of(
    manifest: Manifest, flat: torch.Tensor, tensors: Sequence[torch.Tensor], lo: int, hi: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each contiguous tensor wholly inside elements [lo, hi), of ``flat``'s dtype and
    device, with the view of ``flat`` (the range's buffer) that holds it, in its shape."""
    for t, a, b, at, whole in _pieces(manifest, tensors, lo, hi):
        if whole and t.dtype == flat.dtype and t.device == flat.device and t.is_contiguous():
            yield t, flat[at : at + b - a].view(t.shape)


def state_dict(manifest: Manifest, flat: np.ndarray) -> dict[str, torch.Tensor]:
    """The flat buffer as a ``{name: tensor}`` dict of the manifest's dtypes, that loads with
    ``model.load_state_dict``."""
    out = {}
    for s in manifest.tensors:
        t = torch.from_numpy(flat[s.start : s.start + s.numel].copy()).view(s.shape)
        out[s.name] = t.round().to(torch.int64) if s.role == "count" else t
        out[s.name] = out[s.name].to(getattr(torch, s.dtype))
    return out
