"""The dense codecs: the flat buffer's elements on the worker <-> a wire element type.

``Codec`` sends the flat buffer's own elements (float32, or ``Float64``); ``Float16`` and
``BFloat16`` round them to 16 bits. A worker ``encode``s an uncompressed push into a buffer
reused from push to push and the server ``decode``s every push to its flat buffer's
elements (a 16-bit one with these, whoever encoded it); the server encodes a pull's weights
(a rounded copy: its masters stay float32) and the worker receives them into
``receive_buffer`` and widens them with ``decode_into``. Integer buffers travel exact
(``Codec.exact``). ``--compress fp16`` and ``bf16`` push with ``feedback.Rounded`` (these
types, with an error-feedback residual and the buffers whole); the registry that names
them all is ``compression``.
"""

from __future__ import annotations

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
    block: ClassVar[int] = 0  # elements per float32 scale (``Int8``); 0: no scales

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
    in the flat buffer's (``flat_itemsize``-byte) elements; with a ``block``, a float32
    scale per block of the rest goes first."""
    if codec.raw:
        return numel * codec.itemsize
    scales = 4 * -(-(numel - exact) // codec.block) if codec.block else 0
    return scales + (numel - exact) * codec.itemsize + exact * flat_itemsize


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
