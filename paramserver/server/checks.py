"""A push's gradient checked before the coordinator takes its lock: its element type and
size against the manifest, its sample count, and whether it is finite."""

from __future__ import annotations

import numpy as np

from paramserver.codec.layout import Manifest
from paramserver.errors import InvalidRequest


def check_gradient(
    grad: np.ndarray | None, samples: int, manifest: Manifest, skip_nonfinite: bool, what: str
) -> bool:
    """Whether ``grad`` (None: an empty push) is finite; InvalidRequest if it does not fit
    the manifest, or holds NaN or Inf and the server does not skip such pushes."""
    if grad is not None:
        if grad.dtype != manifest.np_dtype or grad.size != manifest.numel:
            raise InvalidRequest(
                f"A gradient of {grad.size} {grad.dtype} values does not match the model's "
                f"{manifest.numel} {manifest.dtype} values."
            )
        if samples < 0:
            raise InvalidRequest(f"samples {samples} is negative.")
    finite = grad is None or bool(np.isfinite(grad).all())
    if not finite and not skip_nonfinite:
        raise InvalidRequest(
            f"{what} holds NaN or Inf; it was not applied (start the server with "
            "--skip-nonfinite to skip and count such pushes instead)."
        )
    return finite
