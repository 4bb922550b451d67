"""Gradient compression: the flat buffer's elements on the worker <-> a wire element type,
by registry.

Each codec has the name ``--compress`` takes and the dtype a push header names
(``PushHeader.dtype`` in the proto; a test checks the two lists agree). The dense ones
(float32, fp16, bf16, float64: what the server decodes and what pulls carry) are in
``elements``; those that keep an error-feedback residual on the worker (fp16 and bf16
pushes, top-k, int8) in ``feedback``. This module names them, looks them up, and decodes a
top-k push (``sparse_to_dense``); its names are the ones the rest of the package uses.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from paramserver.codec.elements import (
    FP16_MAX,
    BFloat16,
    Codec,
    Float16,
    Float64,
    as_bytes,
    payload_bytes,
)
from paramserver.codec.feedback import (
    Feedback,
    Int8,
    Rounded,
    RoundedBFloat16,
    RoundedFloat16,
    TopK,
)
from paramserver.errors import InvalidRequest

__all__ = [
    "AUTO",
    "BY_DTYPE",
    "CHOICES",
    "COMPRESSION",
    "FP16_MAX",
    "REGISTRY",
    "TOPK",
    "BFloat16",
    "Codec",
    "Feedback",
    "Float16",
    "Float64",
    "Int8",
    "Rounded",
    "RoundedBFloat16",
    "RoundedFloat16",
    "TopK",
    "as_bytes",
    "by_dtype",
    "by_name",
    "payload_bytes",
    "sparse_to_dense",
    "to_float32",
    "wire_dtype",
    "wire_itemsize",
]


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
    if values.block:
        raise InvalidRequest(f"A top-k push's values cannot be {values.dtype}.")
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


# What ``--compress`` pushes: fp16 and bf16 with error feedback (``Rounded``).
REGISTRY: dict[str, type[Codec]] = {
    c.name: c for c in (Codec, RoundedFloat16, RoundedBFloat16, Int8)
}
# What a push header's dtype is decoded with, and what pulls carry: 16 bits without a residual.
_CODECS: tuple[type[Codec], ...] = (Codec, Float16, BFloat16, Float64, Int8)
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
    dense = values in REGISTRY and not REGISTRY[values].block  # not int8
    if len(parts) > 3 or not 0 < fraction <= 1 or not dense:
        raise ValueError(
            f"compress {name!r}: give {TOPK}, F the fraction of each push's entries sent "
            "(0.01: the largest 1%)."
        )
    codec = BY_DTYPE[REGISTRY[values].dtype]  # the values' element type, no residual of its own
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
