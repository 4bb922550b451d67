"""The codecs that lose part of a push and keep it on the worker, to add to the next push
(error feedback): ``Rounded`` (16 bits: ``--compress fp16``, ``bf16``), ``TopK`` (only the
largest entries) and ``Int8`` (8 bits, a scale a block).

All send the buffers (the last ``dense`` elements: values, not gradients) whole in the flat
buffer's type after the gradient's part; keep the residual as long as the codec (one join of
one shard: a rejoin, or a worker that starts again, begins from zero); encode a retried push
(the same ``key``) as the first time without moving the residual; and round a push in place
(``round_``, for a shared segment) to the numbers the server would decode. Pulls are dense,
in ``pulled``'s type.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from paramserver.codec.elements import FP16_MAX, BFloat16, Codec, Float16, payload_bytes
from paramserver.errors import InvalidRequest

if TYPE_CHECKING:  # torch loads on first use, so config and the CLI stay light
    import torch


class Feedback(Codec):
    """A codec with a residual: what its pushes did not carry of the gradients so far."""

    raw = False
    pulled: ClassVar[type[Codec]] = Codec  # the codec of the weights a pull brings

    def __init__(self, numel: int, exact: int = 0, flat: str = "float32", dense: int = 0):
        import torch

        super().__init__(numel, exact, flat)
        self.exact = min(max(dense, exact, 0), numel)  # the dense tail, sent whole
        self.m = numel - self.exact  # the gradients' elements
        self.nbytes = payload_bytes(type(self), numel, self.exact, self.flat.itemsize)
        self.residual = torch.zeros(self.m, dtype=getattr(torch, self.flat.name))
        self.pulls = self.pulled(numel, exact, flat)
        self._key: object = None

    def _pack(self, grad: torch.Tensor, out: np.ndarray) -> None:
        """Write the payload's gradient part of ``grad`` plus the residual into ``out``;
        the residual keeps what it loses."""
        raise NotImplementedError

    def _round(self, grad: torch.Tensor) -> None:
        """``grad`` plus the residual, in place, as the server will decode ``_pack``'s
        bytes; the residual keeps what they lose."""
        raise NotImplementedError

    def encode(self, flat: torch.Tensor, key: object = None) -> memoryview:
        if key is not None and key == self._key and self._out is not None:
            return self._out.data  # a retry: the same bytes, the residual untouched
        if self._out is None:
            self._out = np.empty(self.nbytes, np.uint8)
        split = self.nbytes - self.exact * self.flat.itemsize
        self._pack(flat[: self.m], self._out[:split])
        self._out[split:].view(self.flat)[:] = flat[self.m :].numpy()
        self._key = key
        return self._out.data

    def round_(self, flat: torch.Tensor, key: object = None) -> None:
        if key is not None and key == self._key:
            return  # a retry: ``flat`` holds what was sent already
        self._round(flat[: self.m])
        self._key = key

    def receive_buffer(self, out: torch.Tensor) -> memoryview:
        return self.pulls.receive_buffer(out)

    def decode_into(self, out: torch.Tensor) -> None:
        self.pulls.decode_into(out)


class Rounded(Feedback):
    """A push rounded to a 16-bit type (a subclass's other base: ``Float16``, ``BFloat16``,
    whose name, element type and saturation it takes) with error feedback: the gradient
    plus the residual is sent rounded, then the buffers whole; the residual keeps what the
    rounding lost (at most half a 16-bit ulp an element; fp16's saturation beyond +-65504,
    all of it). An element that is NaN or Inf is sent so (the server refuses the push, or
    skips it with --skip-nonfinite) and its residual is dropped. Pulls are in the same
    16-bit type, integer buffers exact."""

    CHUNK: ClassVar[int] = 1 << 18  # elements a pass (1 MiB of float32): kept in cache

    def __init__(self, numel: int, exact: int = 0, flat: str = "float32", dense: int = 0):
        import torch

        super().__init__(numel, exact, flat, dense)
        chunk = min(self.m, self.CHUNK)
        self._half = torch.empty(chunk, dtype=self.torch_dtype())  # ``round_``'s, a chunk
        self._work = torch.empty(chunk, dtype=self.residual.dtype)  # a chunk sent, widened

    def _send(self, grad: torch.Tensor, half: torch.Tensor | None) -> None:
        """``grad`` plus the residual, rounded into ``half`` (16 bits) or, without it, into
        ``grad`` itself (widened back, as the server decodes it); the residual keeps the
        rest. A chunk at a time: no temporary the size of the gradient."""
        finite = True
        for lo in range(0, self.m, self.CHUNK):
            hi = min(lo + self.CHUNK, self.m)
            acc = self.residual[lo:hi].add_(grad[lo:hi])
            out = self._half[: hi - lo] if half is None else half[lo:hi]
            out.copy_(acc)
            self._fix(out, acc)
            sent = self._work[: hi - lo].copy_(out)
            acc.sub_(sent)  # exactly what the rounding lost
            finite = finite and math.isfinite(float(acc.sum()))
            if half is None:
                grad[lo:hi].copy_(sent)
        if not finite:
            self.residual.nan_to_num_(0.0, 0.0, 0.0)  # a non-finite element's: dropped

    def _pack(self, grad: torch.Tensor, out: np.ndarray) -> None:
        import torch

        self._send(grad, torch.from_numpy(out).view(self.torch_dtype()))

    def _round(self, grad: torch.Tensor) -> None:
        self._send(grad, None)


class RoundedFloat16(Rounded, Float16):
    """``--compress fp16``: pushes in IEEE half precision with error feedback."""

    pulled = Float16


class RoundedBFloat16(Rounded, BFloat16):
    """``--compress bf16``: pushes in bfloat16 with error feedback."""

    pulled = BFloat16


class TopK(Feedback):
    """``--compress topk:F`` (``topk:F:bf16``, ``topk:F:fp16``): a push sends the largest F
    of its gradient's entries by magnitude as (int32 index, value) pairs, the values in
    ``values``' type, then the buffers whole. What it does not send stays in ``residual``
    (error feedback, as Deep Gradient Compression), including the values' rounding. Pulls
    are in ``values``' type."""

    name = "topk"
    fraction: ClassVar[float] = 0.01
    values: ClassVar[type[Codec]] = Codec

    @classmethod
    def configured(cls, fraction: float, values: type[Codec]) -> type[TopK]:
        """The TopK of ``fraction`` with ``values``' element type (one class each)."""
        key = (fraction, values.dtype)
        if key not in _TOPKS:
            attrs = {"fraction": fraction, "values": values, "pulled": values}
            attrs.update(dtype=values.dtype, itemsize=values.itemsize)
            _TOPKS[key] = type(f"TopK_{fraction:g}_{values.dtype}", (cls,), attrs)
        return _TOPKS[key]

    def __init__(self, numel: int, exact: int = 0, flat: str = "float32", dense: int = 0):
        super().__init__(numel, exact, flat, dense)
        self.topk = math.ceil(self.fraction * self.m) if self.m else 0
        self.nbytes = self.topk * (4 + self.itemsize) + self.exact * self.flat.itemsize

    def _select(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs to send of ``grad`` plus the residual, which keeps the rest (and what
        rounding the values lost)."""
        import torch

        acc = self.residual.add_(grad)
        index = torch.topk(acc.abs(), self.topk, sorted=False).indices.to(torch.int32)
        picked = acc[index]
        if self.dtype == "float16":
            picked.clamp_(-FP16_MAX, FP16_MAX)
        sent = picked.to(self.values.torch_dtype())
        acc[index] -= sent.to(acc.dtype)  # what was sent leaves the residual
        return index, sent

    def _pack(self, grad: torch.Tensor, out: np.ndarray) -> None:
        import torch

        index, sent = self._select(grad)
        k, raw = self.topk, torch.from_numpy(out)
        raw[: 4 * k].view(torch.int32).copy_(index)
        raw[4 * k :].view(sent.dtype).copy_(sent)

    def _round(self, grad: torch.Tensor) -> None:
        index, sent = self._select(grad)
        grad.zero_()
        grad[index.long()] = sent.to(grad.dtype)


_TOPKS: dict[tuple[float, str], type[TopK]] = {}


class Int8(Feedback):
    """``--compress int8``: a push sends its gradient's elements as int8, q = round(x / s)
    in [-127, 127], with one float32 scale s = max|x| / 127 per block of ``block`` elements
    (a block of zeros: s = 0, decoded as zeros): the scales, then the int8 values, then the
    buffers whole. What the rounding loses (at most s / 2 an element) stays in ``residual``
    and is added to the next push (error feedback). Pulls are bf16. A block holding NaN or
    Inf goes with a non-finite scale, which decodes to NaN: the server refuses (or, with
    --skip-nonfinite, skips) the push as any non-finite one; that block's residual is
    dropped, so one bad step does not poison every push after it."""

    name = "int8"
    dtype = "int8"
    itemsize = 1
    pulled = BFloat16
    # 1024 elements a scale: its 4 bytes add 0.4% to the int8 payload (1.004 bytes an
    # element against float32's 4); a smaller block follows the gradient's magnitude more
    # closely (a bias, a small layer's gradient, gets its own step instead of sharing a large
    # matrix's) at more scales (256: 1.6%), a larger one saves under 0.3% more.
    block = 1024

    def __init__(self, numel: int, exact: int = 0, flat: str = "float32", dense: int = 0):
        super().__init__(numel, exact, flat, dense)
        self.blocks = -(-self.m // self.block)
        self._work: torch.Tensor | None = None  # the gradient's size, reused from push to push
        self._q: torch.Tensor | None = None  # ``round_``'s int8 values, reused

    def _quantise(self, grad: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``grad`` plus the residual as ``scales`` (float32) and ``q`` (int8); returns
        what they decode to (in a buffer of the codec's), and the residual keeps the
        difference."""
        import torch

        acc = self.residual.add_(grad)
        if self._work is None:  # kept: a fresh one each push would cost its page faults
            self._work = torch.empty_like(acc)
        rows, work = by_block(acc, self.block), by_block(self._work, self.block)
        top = [torch.maximum(r.amax(1), r.amin(1).neg_()) for r in rows]  # max|x|, NaN kept
        scales.copy_(torch.cat(top).div_(127))
        finite = bool(torch.isfinite(scales).all())
        safe = torch.where(scales > 0, scales, 1.0)  # a block of zeros (or NaN): q = 0
        for r, w, s in zip(rows, work, per_row(safe, rows), strict=True):
            torch.div(r, s, out=w)
        if not finite:
            self._work.nan_to_num_(0.0)
        q.copy_(self._work.round_().clamp_(-127, 127))
        sent = dequantise(q, scales, self.block, self._work)
        acc.sub_(sent)
        if not finite:
            acc.nan_to_num_(0.0, 0.0, 0.0)  # a non-finite block's residual: dropped
        return sent

    def _pack(self, grad: torch.Tensor, out: np.ndarray) -> None:
        import torch

        raw = torch.from_numpy(out)
        n = 4 * self.blocks
        self._quantise(grad, raw[:n].view(torch.float32), raw[n:].view(torch.int8))

    def _round(self, grad: torch.Tensor) -> None:
        import torch

        if self._q is None:
            self._q = torch.empty(self.m, dtype=torch.int8)
        grad.copy_(self._quantise(grad, torch.empty(self.blocks), self._q))

    @classmethod
    def decode(
        cls, raw: np.ndarray, exact: int = 0, flat: str = "float32", out: np.ndarray | None = None
    ) -> np.ndarray:
        """An int8 push's bytes (``encode``) as the flat buffer's elements, into ``out``
        when given.

        Raises:
            InvalidRequest: the bytes are not whole scales, int8 values and ``exact``
                elements of ``flat``, or a scale is negative.
        """
        import torch

        data = raw.view(np.uint8)
        tail = exact * np.dtype(flat).itemsize
        head = data.nbytes - tail
        blocks = -(-head // (cls.block + 4))  # head = 4 * ceil(m / block) + m
        m = head - 4 * blocks
        if tail < 0 or m < 0 or -(-m // cls.block) != blocks:
            raise InvalidRequest(
                f"An int8 payload of {data.nbytes} bytes is not a float32 scale per "
                f"{cls.block} elements, their int8 values and {exact} exact {flat} elements."
            )
        scales = data[: 4 * blocks].copy().view(np.float32)
        if bool((scales < 0).any()):
            raise InvalidRequest(
                f"An int8 payload has a negative scale ({float(scales.min())}); a scale "
                "is max|x| / 127."
            )
        out = np.empty(m + exact, flat) if out is None else out[: m + exact]
        q = torch.from_numpy(data[4 * blocks : head]).view(torch.int8)
        dequantise(q, torch.from_numpy(scales), cls.block, torch.from_numpy(out[:m]))
        out[m:] = data[head:].view(flat)
        return out


def by_block(x: torch.Tensor, block: int) -> list[torch.Tensor]:
    """The 1-D ``x`` as rows of ``block`` elements: its whole blocks, then its last, shorter
    one (a row of its own) if it has one."""
    whole = x.numel() // block * block
    rows = [x[:whole].view(-1, block)]
    if whole < x.numel():
        rows.append(x[whole:].view(1, -1))
    return rows


def per_row(scales: torch.Tensor, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """``scales`` (one a block) as a column for each of ``by_block``'s ``rows``."""
    return [s[:, None] for s in scales.split([r.shape[0] for r in rows])]


def dequantise(
    q: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor
) -> torch.Tensor:
    """``out`` = each int8 in ``q`` times its block's scale, in ``out``'s type: the same
    numbers on the worker (its residual, a shared segment's slot rounded in place) and on
    the server (``Int8.decode``). Widened in place, then scaled: no temporary the size of
    ``q`` (a multiply of int8 by float32 would make one)."""
    rows = by_block(q, block)
    for r, s, o in zip(rows, per_row(scales, rows), by_block(out, block), strict=True):
        o.copy_(r).mul_(s)
    return out
