"""A push's gradient checked before the coordinator takes its lock: its element type and
size against the manifest, its sample count, and whether it is finite, its tables' rows
(checked by ``TableSet.check``) included."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from paramserver.codec.layout import Manifest
from paramserver.codec.rows import RowGradients
from paramserver.errors import InvalidRequest
from paramserver.sparse.tableset import finite as rows_finite


def check_gradient(
    grad: np.ndarray | None,
    samples: int,
    manifest: Manifest,
    skip_nonfinite: bool,
    what: str,
    rows: Iterable[RowGradients] = (),
) -> bool:
    """Whether ``grad`` (None: an empty push) and the ``rows`` are finite; InvalidRequest if
    ``grad`` does not fit the manifest, or holds NaN or Inf and the server does not skip
    such pushes (rows with NaN or Inf only get here when it does)."""
    if grad is not None:
        if grad.dtype != manifest.np_dtype or grad.size != manifest.numel:
            raise InvalidRequest(
                f"A gradient of {grad.size} {grad.dtype} values does not match the model's "
                f"{manifest.numel} {manifest.dtype} values."
            )
        if samples < 0:
            raise InvalidRequest(f"samples {samples} is negative.")
    finite = (grad is None or bool(np.isfinite(grad).all())) and rows_finite(rows)
    if not finite and not skip_nonfinite:
        raise InvalidRequest(
            f"{what} holds NaN or Inf; it was not applied (start the server with "
            "--skip-nonfinite to skip and count such pushes instead)."
        )
    return finite
