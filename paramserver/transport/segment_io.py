"""Reading and writing a worker's segment on the server: a sealed one through its mapping
(one memcpy, scanned a piece at a time while in cache), a named one with ``preadv`` and
``pwrite`` (never mapped: its worker may truncate it), large reads and copies split over
the server's threads (``pieces``: ``--server-threads``)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import numpy as np

from paramserver.transport import pieces
from paramserver.transport.shm import _ALIGN

# A gradient at least this large is read or copied by the server's threads at once, a
# piece each (``pieces.split``: at least ``pieces.MIN_PIECE_BYTES`` a piece): a read from
# tmpfs runs at about a third of memcpy's speed (18.5 ms against 5.8 for 64 MiB on the
# 2-core machine, one thread). Writes would not overlap (the kernel takes the file's lock
# for each), so a pull's weights are written by one.
SPLIT_READ_BYTES = 8 << 20
# A sealed segment's gradient is copied and scanned this much at a time: a piece is checked
# while it is still in the core's cache, so the check reads no memory of its own.
SCAN_BYTES = 1 << 20


def _parts(n: int) -> int:
    return pieces.split(n) if n >= SPLIT_READ_BYTES else 1


def read_split(fd: int, view: memoryview, offset: int) -> int:
    """``read_at``, a large ``view`` in pieces on the server's threads (``pieces.run``);
    returns once every piece is read (or failed), so ``fd`` is in use by none after. The
    bytes read: those of the pieces up to the first that came short."""
    parts = _parts(len(view))
    got = pieces.run(lambda lo, hi: read_at(fd, view[lo:hi], offset + lo), len(view), parts, _ALIGN)
    done = 0
    for (lo, hi), n in zip(pieces.bounds(len(view), parts, _ALIGN), got, strict=True):
        done += n
        if n < hi - lo:
            break
    return done


def read_at(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset`` of ``fd`` until it is full or the file ends; the
    bytes read."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def write_at(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` of ``fd`` (a write may take part of it)."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n == 0:
            raise OSError(0, "nothing written")
        done += n


def copy_split(
    view: memoryview,
    mapping: mmap.mmap,
    offset: int,
    scan: Callable[[np.ndarray], None] | None = None,
) -> None:
    """Copy ``len(view)`` bytes at ``offset`` of a sealed segment's ``mapping`` into
    ``view``, ``SCAN_BYTES`` at a time, each piece handed to ``scan`` (if any) from the copy
    while it is still in cache; a large one split over the server's threads, each copying
    its range then scanning it (numpy and BLAS let go of the GIL). Returns once every
    range is copied and scanned (or failed)."""
    n = len(view)
    out = np.frombuffer(view, np.uint8)
    src = np.frombuffer(mapping, np.uint8, n, offset)

    def copy(lo: int, hi: int) -> None:
        for a in range(lo, hi, SCAN_BYTES):
            b = min(a + SCAN_BYTES, hi)
            out[a:b] = src[a:b]
            if scan is not None:
                scan(out[a:b])

    pieces.run(copy, n, _parts(n), _ALIGN)
