"""A push's gradient checked before the coordinator takes its lock: its element type and
size against the manifest, its sample count, and whether it is finite, its tables' rows
(checked by ``TableSet.check``) included."""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Iterable

import numpy as np

from paramserver.codec.layout import Manifest
from paramserver.codec.rows import RowGradients
from paramserver.errors import InvalidRequest
from paramserver.sparse.tableset import TableSet
from paramserver.sparse.tableset import finite as rows_finite
from paramserver.transport import pieces

# A check of at least this many bytes is split over the server's threads (``pieces``:
# ``--server-threads``), a piece each: the dot product lets go of the GIL.
SPLIT_CHECK_BYTES = 8 << 20


def all_finite(values: np.ndarray) -> bool:
    """Whether every element of the float array ``values`` is finite; a large one checked
    in pieces on the server's threads at once (``SPLIT_CHECK_BYTES``; a piece each).

    One read of the array, no temporary: the sum of squares is finite only if every element
    is (a NaN or an Inf makes it NaN or Inf), which BLAS computes at memory speed (1.7 ms
    for 64 MiB here, against 3.3 ms for ``np.isfinite(values).all()``, which writes a mask).
    Where it is not finite (non-finite elements, or squares of finite ones past the type's
    range) the exact element-wise test decides."""
    flat = values.reshape(-1)
    parts = pieces.split(flat.nbytes) if flat.nbytes >= SPLIT_CHECK_BYTES else 1
    if parts == 1:
        return _finite(flat)
    return all(pieces.run(lambda lo, hi: _finite(flat[lo:hi]), flat.size, parts, 64))


def _finite(flat: np.ndarray) -> bool:
    with np.errstate(over="ignore", invalid="ignore"):
        if flat.size and math.isfinite(float(np.dot(flat, flat))):
            return True
    return bool(np.isfinite(flat).all())


class Scan:
    """Whether a gradient is finite, found piece by piece while it is copied (``__call__``
    with each piece's bytes, whole elements of ``dtype``): a piece is checked while it is
    still in cache. Pieces may be checked from two threads at once."""

    def __init__(self, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.finite = True

    def __call__(self, piece: np.ndarray | memoryview) -> None:
        if self.finite and not all_finite(np.frombuffer(piece, self.dtype)):
            self.finite = False


# The threads that check pieces behind a receive (``Behind``), shared by every connection:
# two keep up with any socket (a piece is checked at memory speed), so they are not the
# server's threads (``pieces``).
_SCANNERS = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ps-scan")


class Behind:
    """``scan`` run on a helper thread while the next piece arrives (a socket's receive
    and the check both let go of the GIL): ``wait`` once every piece is in."""

    def __init__(self, scan: Scan):
        self.scan = scan
        self._done: list[concurrent.futures.Future[None]] = []

    def __call__(self, piece: memoryview) -> None:
        self._done.append(_SCANNERS.submit(self.scan, piece))

    def wait(self) -> bool:
        """Whether every piece was finite (raises what a check raised)."""
        for f in self._done:
            f.result()
        return self.scan.finite


def check_push(
    tables: TableSet | None,
    manifest: Manifest,
    grad: np.ndarray | None,
    rows: Iterable[RowGradients],
    samples: int,
    skip: bool,
    what: str,
    finite: bool | None = None,
) -> tuple[list[RowGradients], bool]:
    """A push's ``rows`` checked against ``tables`` and whether it is finite, gradient and
    rows (``check_gradient``; NaN or Inf anywhere is skipped and counted with
    ``--skip-nonfinite``).

    Raises:
        InvalidRequest: rows for a model without tables, or what ``check_gradient`` refuses.
    """
    checked: list[RowGradients] = []
    if rows:
        if tables is None:
            raise InvalidRequest("A push names sparse tables, but this model has none.")
        checked = tables.check(rows, skip)
    return checked, check_gradient(grad, samples, manifest, skip, what, checked, finite)


def check_gradient(
    grad: np.ndarray | None,
    samples: int,
    manifest: Manifest,
    skip_nonfinite: bool,
    what: str,
    rows: Iterable[RowGradients] = (),
    finite: bool | None = None,
) -> bool:
    """Whether ``grad`` (None: an empty push) and the ``rows`` are finite; InvalidRequest if
    ``grad`` does not fit the manifest, or holds NaN or Inf and the server does not skip
    such pushes (rows with NaN or Inf only get here when it does). ``finite``: what a
    ``Scan`` found while ``grad`` was copied (None: look now)."""
    if grad is not None:
        if grad.dtype != manifest.np_dtype or grad.size != manifest.numel:
            raise InvalidRequest(
                f"A gradient of {grad.size} {grad.dtype} values does not match the model's "
                f"{manifest.numel} {manifest.dtype} values."
            )
        if samples < 0:
            raise InvalidRequest(f"samples {samples} is negative.")
    if grad is not None and finite is None:
        finite = all_finite(grad)
    finite = finite is not False and rows_finite(rows)
    if not finite and not skip_nonfinite:
        raise InvalidRequest(
            f"{what} holds NaN or Inf; it was not applied (start the server with "
            "--skip-nonfinite to skip and count such pushes instead)."
        )
    return finite
