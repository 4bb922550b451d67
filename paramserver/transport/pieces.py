"""A large buffer's work split into pieces, one a thread, on the server's threads
(``--server-threads``, set at start by ``set_threads``): numpy's copies, BLAS's dot and
``preadv`` let go of the GIL, so N pieces run on N cores at once. The calling thread runs
the first piece itself and the pool's N - 1 threads the others; a piece never waits on
another, so any number of callers share the pool without deadlock, and work asked for on
a pool thread runs there whole (never split again).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np

T = TypeVar("T")

# A piece is at least this large: below it a thread's hand-off costs more than it saves
# (an 8 MiB copy out of shared memory was measured split in two).
MIN_PIECE_BYTES = 4 << 20

_lock = threading.Lock()
_threads = 1
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_on_pool = threading.local()  # .yes on the pool's threads


def set_threads(n: int) -> None:
    """Split large work into ``n`` pieces from now on (at least 1): the server's threads."""
    global _threads, _pool
    n = max(1, int(n))
    with _lock:
        if n == _threads:
            return
        old, _threads = _pool, n
        _pool = (
            concurrent.futures.ThreadPoolExecutor(
                n - 1, thread_name_prefix="ps-piece", initializer=_mark
            )
            if n > 1
            else None
        )
    if old is not None:
        old.shutdown(wait=False)  # pieces already handed to it still run


def threads() -> int:
    """The threads large work is split over."""
    return _threads


def _mark() -> None:
    _on_pool.yes = True


def bounds(n: int, parts: int, align: int) -> list[tuple[int, int]]:
    """``[0, n)`` as at most ``parts`` contiguous ``(lo, hi)`` ranges of nearly equal size,
    every boundary but ``n`` a multiple of ``align``, none empty (``[(0, n)]`` if it cannot
    be split)."""
    parts = max(1, min(parts, n // max(align, 1)))
    step = -(-n // parts // align) * align if parts > 1 else n
    edges = [*range(0, n, step), n] if step else [0, n]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:], strict=False) if hi > lo] or [(0, n)]


def split(nbytes: int) -> int:
    """The pieces work over ``nbytes`` bytes is split into here: the server's threads, as
    many as keep each piece ``MIN_PIECE_BYTES`` or more; 1 on a pool thread."""
    if getattr(_on_pool, "yes", False):
        return 1
    return max(1, min(_threads, nbytes // MIN_PIECE_BYTES))


def run(fn: Callable[[int, int], T], n: int, parts: int, align: int) -> list[T]:
    """``fn(lo, hi)`` for each range of ``bounds(n, parts, align)``, the first on this
    thread and the others on the pool; the results in order. Returns once every piece has
    run or failed (none still runs after), raising the first failure."""
    ranges = bounds(n, parts, align)
    pool = _pool
    if len(ranges) == 1 or pool is None:
        return [fn(lo, hi) for lo, hi in ranges]
    rest = []
    try:
        for lo, hi in ranges[1:]:
            rest.append(pool.submit(fn, lo, hi))
    except RuntimeError:  # the pool was replaced and shut down meanwhile: run them here
        pass
    try:
        first = fn(*ranges[0])
    finally:
        concurrent.futures.wait(rest)
    out = [first, *(f.result() for f in rest)]
    for lo, hi in ranges[1 + len(rest) :]:
        out.append(fn(lo, hi))
    return out


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)`` of two C-contiguous arrays of one size in bytes, a large one
    split over the server's threads (one memory-bound pass: 80 MB took 14 ms on one core of
    a GPU host, a step's share of a 20M-parameter model's pull). Returns once all is copied."""
    if dst.nbytes != src.nbytes or not (dst.flags.c_contiguous and src.flags.c_contiguous):
        raise ValueError("pieces.copy takes two contiguous arrays of one size in bytes")
    out, into = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)

    def part(lo: int, hi: int) -> None:
        into[lo:hi] = out[lo:hi]

    run(part, out.size, split(out.size), 64)
