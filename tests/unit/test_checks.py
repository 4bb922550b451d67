"""The finiteness test every push's gradient passes (server/engine/checks.py): its fast path (a
sum of squares) never calls a non-finite gradient finite, nor a finite one non-finite."""

from __future__ import annotations

import numpy as np
import pytest

from paramserver.server.engine.checks import Scan, all_finite


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_finds_every_nan_and_inf_wherever_it_is(dtype):
    values = np.linspace(-1.0, 1.0, 10_001, dtype=dtype)
    assert all_finite(values)
    for bad in (np.nan, np.inf, -np.inf):
        for at in (0, 5_000, 10_000):
            spoiled = values.copy()
            spoiled[at] = bad
            assert not all_finite(spoiled), (bad, at)
    assert all_finite(np.zeros(0, dtype))


def test_finite_values_whose_squares_overflow_are_still_finite():
    big = np.full(1_000, np.finfo(np.float32).max / 2, np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.dot(big, big))  # the fast path cannot tell...
    assert all_finite(big)  # ...so the exact test decides
    big[500] = np.nan
    assert not all_finite(big)


def test_a_scan_piece_by_piece_finds_what_the_whole_check_finds():
    values = np.linspace(-1.0, 1.0, 4096, dtype=np.float32)
    for bad in (None, 0, 1023, 1024, 4095):
        if bad is not None:
            values[bad] = np.nan
        scan = Scan(np.float32)
        raw = values.view(np.uint8)
        for lo in range(0, raw.size, 4096):  # pieces of 1024 elements
            scan(raw[lo : lo + 4096])
        assert scan.finite is (bad is None) is all_finite(values), bad
        values[:] = np.linspace(-1.0, 1.0, 4096, dtype=np.float32)
