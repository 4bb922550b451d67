"""A worker's heap with tables: each step allocates and frees buffers of a batch's rows (tens
of MB for wide tables). glibc raises its mmap threshold to the size of the largest block
freed, so after the first steps such buffers come from the heap, whose freed pages it keeps:
measured with ``bench sparse``'s big table, a worker's resident memory grew by about 15 MB
a step (504 to 929 MB over 30 steps) and stayed flat (432 MB) with the threshold fixed.
``fix_mmap_threshold`` fixes it at 128 KiB (glibc's default, without the raising), so
large blocks go back to the system when freed. Elsewhere than glibc it does nothing.

A server with tables fixes it too: a table's arrays grow by replacing them, and its pushes
allocate temporaries; with the threshold fixed a shard's resident memory grew by about 250
bytes per row held (2M rows, lazy adam, dim 16) against 341 with glibc's raising
(``python -m paramserver.bench.sparse_rows 2000000``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
THRESHOLD = 128 * 1024


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold (this process); False where it cannot."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        done = bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD))
    except (OSError, AttributeError):
        return False
    log.debug("glibc mmap threshold fixed at %d bytes: %s", THRESHOLD, done)
    return done
