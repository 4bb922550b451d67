"""Gradient compression: the flat buffer's elements on the worker <-> a wire element type,
by registry.

Each codec has the name ``--compress`` takes and the dtype a push header names
(``PushHeader.dtype`` in the proto; a test checks the two lists agree). ``encode`` runs on
the worker, into a buffer reused from push to push; ``decode`` gives what the server
received as float32 (float64 for a float64 payload), which the server widens to its flat
buffer's dtype. A float64 model's flat buffer goes on the wire as it is (``Float64``).
"""

from __future__ import annotations

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
    """No compression: float32 on the wire, encoded and decoded without a copy."""

    name: ClassVar[str] = "none"
    dtype: ClassVar[str] = "float32"
    itemsize: ClassVar[int] = 4
    raw: ClassVar[bool] = True  # the flat buffer's own elements: no cast

    def __init__(self, numel: int):
        import torch

        self._buf = None if self.raw else torch.empty(numel, dtype=self.torch_dtype())

    @classmethod
    def torch_dtype(cls) -> torch.dtype:
        import torch

        return getattr(torch, cls.dtype)

    def encode(self, flat: torch.Tensor) -> memoryview:
        """The wire bytes of the flat CPU tensor ``flat`` (valid until the next call)."""
        if self._buf is None:
            return as_bytes(flat.numpy())
        import torch

        self._buf.copy_(flat)
        self._fix(flat)
        return as_bytes(self._buf.view(torch.int16).numpy())

    def _fix(self, flat: torch.Tensor) -> None:
        """Mend ``_buf`` after the cast where the type needs it."""

    @classmethod
    def decode(cls, raw: np.ndarray) -> np.ndarray:
        """A received payload (raw ``dtype`` elements, any integer view) as float32 (as
        float64 if it is float64)."""
        if cls.raw:
            return raw.view(cls.dtype)
        import torch

        return torch.from_numpy(raw.view(np.int16)).view(cls.torch_dtype()).float().numpy()


class Float16(Codec):
    """IEEE half precision. Values beyond +-65504 saturate instead of becoming Inf, which the
    server would refuse; a gradient that holds NaN or Inf keeps them."""

    name = "fp16"
    dtype = "float16"
    itemsize = 2
    raw = False

    def _fix(self, flat: torch.Tensor) -> None:
        import torch

        assert self._buf is not None
        if bool(torch.isinf(self._buf).any()):
            saturated = flat.clamp(-FP16_MAX, FP16_MAX)
            self._buf.copy_(torch.where(torch.isfinite(flat), saturated, flat))


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


REGISTRY: dict[str, type[Codec]] = {c.name: c for c in (Codec, Float16, BFloat16)}
_CODECS: tuple[type[Codec], ...] = (Codec, Float16, BFloat16, Float64)
BY_DTYPE: dict[str, type[Codec]] = {c.dtype: c for c in _CODECS}
# ``--compress auto``: the parameters' own dtype when they all share a 16-bit one, else none.
AUTO = "auto"
# ``--compress`` choices, and what each puts on the wire.
CHOICES: tuple[str, ...] = (AUTO, *REGISTRY)
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
    if name not in REGISTRY:
        raise ValueError(f"compress must be one of {', '.join(CHOICES)}; got {name!r}.")
    codec = REGISTRY[name]
    return BY_DTYPE[flat_dtype] if codec.raw else codec


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


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """A received payload (raw bytes of ``dtype`` elements) as float32 (float64 if so)."""
    return by_dtype(dtype).decode(raw)
