"""Gradient compression: the flat buffer's elements on the worker <-> a wire element type,
by registry.

Each codec has the name ``--compress`` takes and the dtype a push header names
(``PushHeader.dtype`` in the proto; a test checks the two lists agree). Both directions use
it: a worker ``encode``s a push into a buffer reused from push to push and the server
``decode``s it to its flat buffer's elements; the server encodes a pull's weights (a
rounded copy: its masters stay float32) and the worker receives them into
``receive_buffer`` and widens them with ``decode_into``. Integer buffers travel exact
(``Codec.exact``). A float64 model's flat buffer goes on the wire as it is (``Float64``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from paramserver.errors import InvalidRequest

if TYPE_CHECKING:  # torch loads on first use, so config and the CLI stay light
    import torch

FP16_MAX = 65504.0


def as_bytes(array: np.ndarray) -> memoryview:
    """A zero-copy byte view of a contiguous array."""
    return np.ascontiguousarray(array).view(np.uint8).data


class Codec:
    """No compression: the flat buffer's own elements on the wire, without a copy.

    A 16-bit codec (a subclass with ``raw`` False) sends the first ``numel - exact``
    elements in its ``dtype`` and the last ``exact`` in the flat buffer's (``flat``): those
    are the integer buffers (``num_batches_tracked``), which the flat buffer's sections put
    last and which must never be rounded (``Manifest.exact_tail``).
    """

    name: ClassVar[str] = "none"
    dtype: ClassVar[str] = "float32"
    itemsize: ClassVar[int] = 4
    raw: ClassVar[bool] = True  # the flat buffer's own elements: no cast

    def __init__(self, numel: int, exact: int = 0, flat: str = "float32", dense: int = 0):
        """``exact``: the last elements never rounded (integer buffers); ``dense``: the last
        elements that are not gradients (all buffers), which only ``TopK`` tells apart."""
        self.numel, self.flat = numel, np.dtype(flat)
        self.exact = min(max(exact, 0), numel) if not self.raw else 0
        self.nbytes = payload_bytes(type(self), numel, self.exact, self.flat.itemsize)
        self.pulls: Codec = self  # the codec of the weights a pull brings
        self.topk = 0  # (index, value) pairs a push carries; 0: dense
        self._out: np.ndarray | None = None  # encoded payloads, reused
        self._in: np.ndarray | None = None  # received payloads, reused

    @classmethod
    def torch_dtype(cls) -> torch.dtype:
        import torch

        return getattr(torch, cls.dtype)

    def encode(self, flat: torch.Tensor, key: object = None) -> memoryview:
        """The wire bytes of the flat CPU tensor ``flat`` (valid until the next call).
        ``key`` names the push (its slot and iteration): a retry of it encodes the same."""
        if self.raw:
            return as_bytes(flat.numpy())
        if self._out is None:
            self._out = np.empty(self.nbytes, np.uint8)
        half, tail = self._parts(self._out)
        split = self.numel - self.exact
        half.copy_(flat[:split])
        self._fix(half, flat[:split])
        tail[:] = flat[split:].numpy()
        return self._out.data

    def _parts(self, raw: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """The 16-bit head (a tensor) and the exact tail (an array, maybe unaligned) of a
        payload's bytes, over them."""
        import torch

        split = (self.numel - self.exact) * self.itemsize
        head = torch.from_numpy(raw[:split]).view(self.torch_dtype())
        return head, raw[split:].view(self.flat)

    def _fix(self, half: torch.Tensor, flat: torch.Tensor) -> None:
        """Mend ``half`` after the cast where the type needs it."""

    def round_(self, flat: torch.Tensor, key: object = None) -> None:
        """Round ``flat`` in place as a trip through the wire would (its exact tail kept):
        the same numbers for a payload that never leaves the host (a shared segment)."""
        if self.raw:
            return
        split = self.numel - self.exact
        half = flat[:split].to(self.torch_dtype())
        self._fix(half, flat[:split])
        flat[:split].copy_(half)

    def receive_buffer(self, out: torch.Tensor) -> memoryview:
        """Where a payload for ``out`` (the flat range it decodes into) lands: ``out``
        itself when raw, else a buffer of the codec's, reused; ``decode_into`` after."""
        if self.raw:
            return as_bytes(out.numpy())
        if self._in is None:
            self._in = np.empty(self.nbytes, np.uint8)
        return self._in.data

    def decode_into(self, out: torch.Tensor) -> None:
        """Widen what ``receive_buffer`` received into ``out`` (nothing to do when raw)."""
        if self.raw:
            return
        assert self._in is not None, "decode_into follows receive_buffer"
        half, tail = self._parts(self._in)
        split = self.numel - self.exact
        out[:split].copy_(half)
        out[split:].numpy()[:] = tail

    @classmethod
    def decode(
        cls, raw: np.ndarray, exact: int = 0, flat: str = "float32", out: np.ndarray | None = None
    ) -> np.ndarray:
        """A received payload (its bytes, any integer view) as the flat buffer's elements
        (float32, or float64); ``exact`` elements at its end came in ``flat``. Widened into
        ``out`` (at least as many ``flat`` elements; the decoded ones are its first) when
        given, else into a new array; a raw payload is viewed as it is.

        Raises:
            InvalidRequest: ``exact`` is more than the payload holds.
        """
        data = raw.view(np.uint8)
        if cls.raw:
            return data.view(cls.dtype)
        import torch

        tail_bytes = exact * np.dtype(flat).itemsize
        if not 0 <= tail_bytes <= data.nbytes or (data.nbytes - tail_bytes) % cls.itemsize:
            raise InvalidRequest(
                f"A {cls.dtype} payload of {data.nbytes} bytes cannot end in {exact} exact "
                f"{flat} elements."
            )
        head = torch.from_numpy(data[: data.nbytes - tail_bytes]).view(cls.torch_dtype())
        numel = head.numel() + exact
        out = np.empty(numel, flat) if out is None else out[:numel]
        torch.from_numpy(out[: head.numel()]).copy_(head)
        out[head.numel() :] = data[data.nbytes - tail_bytes :].view(flat)
        return out


def payload_bytes(codec: type[Codec], numel: int, exact: int = 0, flat_itemsize: int = 4) -> int:
    """The bytes of ``numel`` elements in ``codec``'s wire form, the last ``exact`` of them
    in the flat buffer's (``flat_itemsize``-byte) elements."""
    if codec.raw:
        return numel * codec.itemsize
    return (numel - exact) * codec.itemsize + exact * flat_itemsize


class Float16(Codec):
    """IEEE half precision. Values beyond +-65504 saturate instead of becoming Inf, which the
    server would refuse; a gradient that holds NaN or Inf keeps them."""

    name = "fp16"
    dtype = "float16"
    itemsize = 2
    raw = False

    def _fix(self, half: torch.Tensor, flat: torch.Tensor) -> None:
        import torch

        if bool(torch.isinf(half).any()):
            saturated = flat.clamp(-FP16_MAX, FP16_MAX)
            half.copy_(torch.where(torch.isfinite(flat), saturated, flat))


class BFloat16(Codec):
    """bfloat16: float32's range, 8 bits of mantissa."""

    name = "bf16"
    dtype = "bfloat16"
    itemsize = 2
    raw = False


class Float64(Codec):
    """A float64 model's flat buffer, uncompressed; chosen by "none" and "auto" for it."""

    name = "none"
    dtype = "float64"
    itemsize = 8


class TopK(Codec):
    """``--compress topk:F`` (``topk:F:bf16``, ``topk:F:fp16``): a push sends the largest F
    of its gradient's entries by magnitude as (int32 index, value) pairs, the values in
    ``values``' type, then the buffers (the last ``dense`` elements) whole in the flat
    buffer's. What it does not send stays in ``residual`` and is added to the next push's
    gradient (error feedback, as Deep Gradient Compression), including the values' rounding;
    the residual lives as long as this codec, i.e. one join of one shard. Pulls are dense,
    in ``values``' type (``pulls``)."""

    name = "topk"
    raw = False
    fraction: ClassVar[float] = 0.01
    values: ClassVar[type[Codec]] = Codec

    @classmethod
    def configured(cls, fraction: float, values: type[Codec]) -> type[TopK]:
        """The TopK of ``fraction`` with ``values``' element type (one class each)."""
        key = (fraction, values.dtype)
        if key not in _TOPKS:
            attrs = {"fraction": fraction, "values": values}
            attrs.update(dtype=values.dtype, itemsize=values.itemsize)
            _TOPKS[key] = type(f"TopK_{fraction:g}_{values.dtype}", (cls,), attrs)
        return _TOPKS[key]

    def __init__(self, numel: int, exact: int = 0, flat: str = "float32", dense: int = 0):
        import torch

        super().__init__(numel, exact, flat)
        self.exact = min(max(dense, exact, 0), numel)  # the dense tail, sent whole
        self.m = numel - self.exact  # the gradients' elements
        self.topk = math.ceil(self.fraction * self.m) if self.m else 0
        self.nbytes = self.topk * (4 + self.itemsize) + self.exact * self.flat.itemsize
        self.residual = torch.zeros(self.m, dtype=getattr(torch, self.flat.name))
        self.pulls = self.values(numel, exact, flat)
        self._key: object = None

    def _select(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs to send of ``flat``'s gradient plus the residual, which keeps the rest
        (and what rounding the values lost)."""
        import torch

        acc = self.residual.add_(flat[: self.m])
        index = torch.topk(acc.abs(), self.topk, sorted=False).indices.to(torch.int32)
        picked = acc[index]
        if self.dtype == "float16":
            picked.clamp_(-FP16_MAX, FP16_MAX)
        sent = picked.to(self.values.torch_dtype())
        acc[index] -= sent.to(acc.dtype)  # what was sent leaves the residual
        return index, sent

    def encode(self, flat: torch.Tensor, key: object = None) -> memoryview:
        import torch

        if key is not None and key == self._key and self._out is not None:
            return self._out.data  # a retry: the same pairs, the residual untouched
        if self._out is None:
            self._out = np.empty(self.nbytes, np.uint8)
        index, sent = self._select(flat)
        k, out = self.topk, torch.from_numpy(self._out)
        out[: 4 * k].view(torch.int32).copy_(index)
        out[4 * k : (4 + self.itemsize) * k].view(sent.dtype).copy_(sent)
        self._out[(4 + self.itemsize) * k :].view(self.flat)[:] = flat[self.m :].numpy()
        self._key = key
        return self._out.data

    def round_(self, flat: torch.Tensor, key: object = None) -> None:
        if key is not None and key == self._key:
            return  # a retry: ``flat`` holds the pairs already
        index, sent = self._select(flat)
        flat[: self.m].zero_()
        flat[index.long()] = sent.to(flat.dtype)
        self._key = key

    def receive_buffer(self, out: torch.Tensor) -> memoryview:
        return self.pulls.receive_buffer(out)

    def decode_into(self, out: torch.Tensor) -> None:
        self.pulls.decode_into(out)


_TOPKS: dict[tuple[float, str], type[TopK]] = {}


def sparse_to_dense(
    raw: np.ndarray,
    k: int,
    dtype: str,
    exact: int,
    numel: int,
    flat: str = "float32",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """A top-k push's bytes (``TopK.encode``) as the dense gradient of ``numel`` elements,
    written into ``out`` (its first ``numel``) when given, else into a new array.

    Raises:
        InvalidRequest: the sizes disagree, or an index is outside the gradients.
    """
    values = by_dtype(dtype)
    data, m = raw.view(np.uint8), numel - exact
    if not 0 < k <= m or data.nbytes != k * (4 + values.itemsize) + exact * np.dtype(flat).itemsize:
        raise InvalidRequest(
            f"A top-k push of {data.nbytes} bytes cannot hold {k} pairs of {values.dtype} and "
            f"{exact} whole elements of {numel}."
        )
    index = data[: 4 * k].view(np.int32)
    if int(index.min()) < 0 or int(index.max()) >= m:
        raise InvalidRequest(f"A top-k push names an element outside the gradient's {m}.")
    out = np.empty(numel, flat) if out is None else out[:numel]
    out[:m] = 0
    out[index] = values.decode(data[4 * k : (4 + values.itemsize) * k].copy())
    out[m:] = data[(4 + values.itemsize) * k :].view(flat)
    return out


REGISTRY: dict[str, type[Codec]] = {c.name: c for c in (Codec, Float16, BFloat16)}
_CODECS: tuple[type[Codec], ...] = (Codec, Float16, BFloat16, Float64)
BY_DTYPE: dict[str, type[Codec]] = {c.dtype: c for c in _CODECS}
# ``--compress auto``: the parameters' own dtype when they all share a 16-bit one, else none.
AUTO = "auto"
# ``--compress`` choices, and what each puts on the wire; and ``topk:F[:fp16|:bf16]``.
CHOICES: tuple[str, ...] = (AUTO, *REGISTRY)
TOPK = "topk:F[:fp16|:bf16]"
COMPRESSION = {name: c.dtype for name, c in REGISTRY.items()}


def by_name(
    name: str, param_dtypes: Iterable[str] = (), flat_dtype: str = "float32"
) -> type[Codec]:
    """The codec ``--compress name`` selects for a flat buffer of ``flat_dtype``; for
    "auto", the one whose wire dtype is that of every parameter in ``param_dtypes``
    (float16, bfloat16), else none. None sends the flat buffer's own elements (float32,
    or ``Float64``).

    Raises:
        ValueError: no such codec (config turns it into a ConfigError).
    """
    if name == AUTO:
        dtypes = set(param_dtypes)
        name = next((c.name for c in REGISTRY.values() if dtypes == {c.dtype}), "none")
    if name.startswith("topk:"):
        return _topk(name, flat_dtype)
    if name not in REGISTRY:
        raise ValueError(f"compress must be one of {', '.join(CHOICES)} or {TOPK}; got {name!r}.")
    codec = REGISTRY[name]
    return BY_DTYPE[flat_dtype] if codec.raw else codec


def _topk(name: str, flat_dtype: str) -> type[Codec]:
    """``topk:F`` or ``topk:F:fp16|bf16``, F in (0, 1]."""
    parts = name.split(":")
    try:
        fraction = float(parts[1])
    except ValueError:
        fraction = -1.0
    values = parts[2] if len(parts) == 3 else "none"
    if len(parts) > 3 or not 0 < fraction <= 1 or values not in REGISTRY:
        raise ValueError(
            f"compress {name!r}: give {TOPK}, F the fraction of each push's entries sent "
            "(0.01: the largest 1%)."
        )
    codec = REGISTRY[values]
    return TopK.configured(fraction, BY_DTYPE[flat_dtype] if codec.raw else codec)


def by_dtype(name: str) -> type[Codec]:
    """The codec of the element type a push header names ("" is float32).

    Raises:
        InvalidRequest: not a wire dtype.
    """
    codec = BY_DTYPE.get(name or "float32")
    if codec is None:
        raise InvalidRequest(
            f"Unknown payload dtype {name!r}: this server takes {', '.join(BY_DTYPE)}."
        )
    return codec


def wire_dtype(name: str) -> str:
    """The element type a push header names, checked ("" is float32)."""
    return by_dtype(name).dtype


def wire_itemsize(name: str) -> int:
    """Bytes per element of the wire dtype ``name``."""
    return by_dtype(name).itemsize


def to_float32(
    raw: np.ndarray,
    dtype: str,
    exact: int = 0,
    flat: str = "float32",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """A received payload (raw bytes of ``dtype`` elements, the last ``exact`` in ``flat``)
    as the flat buffer's elements (float32, or float64), widened into ``out`` if given."""
    return by_dtype(dtype).decode(raw, exact, flat, out)
