"""A worker's heap with tables: each step allocates and frees buffers of a batch's rows (tens
of MB for wide tables). glibc raises its mmap threshold to the size of the largest block
freed, so after the first steps such buffers come from the heap, whose freed pages it keeps:
measured with ``bench sparse``'s big table, a worker's resident memory grew by about 15 MB
a step (504 to 929 MB over 30 steps) and stayed flat (432 MB) with the threshold fixed.
``fix_mmap_threshold`` fixes it at 128 KiB (glibc's default, without the raising), so
large blocks go back to the system when freed. Elsewhere than glibc it does nothing.

A server with tables fixes it too, at ``SERVER_MMAP_THRESHOLD`` (4 MiB): a table's arrays
grow by replacing them, and with glibc's raising the old ones' memory stayed in the heap
(341 bytes of resident memory per row held, 2M rows, lazy adam, dim 16; 239 with the
threshold fixed: ``python -m paramserver.bench.tables.row_memory 2000000``). At 128 KiB every
push's temporaries (a few hundred KB) were mapped and unmapped each time, and the server
of ``bench sparse`` (a) served 13% fewer samples/s; at 4 MiB they stay in the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
THRESHOLD = 128 * 1024
SERVER_MMAP_THRESHOLD = 4 << 20


def fix_mmap_threshold(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (this process); False where it
    cannot."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        done = bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
    log.debug("glibc mmap threshold fixed at %d bytes: %s", threshold, done)
    return done
