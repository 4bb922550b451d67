"""What checkpointing a shard's table costs in memory and time, without the wire: a table
of ROWS rows (lazy adam, dim 16) held whole, then each phase of its checkpoints measured
by the peak growth of the process's anonymous resident memory (glibc's mmap threshold fixed
as a server process fixes it) (``RssAnon``, sampled every
millisecond by a thread: file pages that the mapped row files bring in are the kernel's
cache, not the process's) against the table's own bytes:

- ``base``: the first checkpoint, every row changed (a copy of the rows, then written);
- ``delta``: after pushes that touch 1% of the rows, a checkpoint of those rows only;
- ``merge``: the base and 7 deltas merged on disk into a new base (``row_format.compact``);
- ``restore``: a fresh shard's table rebuilt from the chain (the table itself is what a
  restore must hold: its growth is the table, the rest is the chunk buffers).

Issue 28's note and docs/BENCHMARKS.md quote it. Run:
    .venv/bin/python docs/measure_table_checkpoint.py [ROWS]   (default 2,000,000)
"""

import ctypes
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from paramserver.codec.rows import RowGradients, TableSpec
from paramserver.server.disk import row_format
from paramserver.server.disk.row_reader import RowChain
from paramserver.server.disk.row_writer import RowLog
from paramserver.sparse.memory import SERVER_MMAP_THRESHOLD, fix_mmap_threshold
from paramserver.sparse.tableset import TableSet, row_optimizer

ROWS = int(sys.argv[1]) if len(sys.argv) > 1 else 2_000_000
DIM = 16
LIBC = ctypes.CDLL("libc.so.6")


def anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class Peak:
    """The peak growth of RssAnon over a ``with`` block, and its seconds."""

    def __enter__(self) -> "Peak":
        LIBC.malloc_trim(0)  # memory freed before is given back: growth is this phase's
        self.start, self.peak, self.done = anon_mb(), 0.0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, anon_mb() - self.start)

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.peak = max(self.peak, anon_mb() - self.start)
        self.done.set()
        self.thread.join()


def tables() -> TableSet:
    return TableSet([TableSpec("t", ROWS, DIM)], row_optimizer("adam", 0.01))


def push(ts: TableSet, ids: np.ndarray, step: int) -> None:
    for lo in range(0, len(ids), 1 << 18):
        part = ids[lo : lo + (1 << 18)]
        ts.apply(ts.check([RowGradients("t", part, torch.ones(len(part), DIM))]), step=step)


torch.set_num_threads(1)
fix_mmap_threshold(SERVER_MMAP_THRESHOLD)  # as a server process does
rng = np.random.default_rng(0)
live = tables()
push(live, np.arange(ROWS), 1)
table_mb = live.table("t").nbytes() / 2**20
row_bytes = DIM * 4 * 3 + 8 + 4 + 4  # values, two moments, steps, hits, last
rows_mb = ROWS * row_bytes / 2**20
out: dict[str, float] = {"rows": ROWS, "table_mb": round(table_mb, 1), "rows_mb": round(rows_mb, 1)}
with tempfile.TemporaryDirectory() as tmp:
    log = RowLog(Path(tmp), 0, 1, None, full_every=8)
    with Peak() as p:
        log.write(live.take_changes(), live.layouts())
    out.update(base_peak_mb=round(p.peak, 1), base_s=round(p.seconds, 2))
    deltas = []
    for step in range(2, 9):
        push(live, np.unique(rng.integers(0, ROWS, ROWS // 100)), step)
        with Peak() as p:
            changes = live.take_changes()
            names, sums = log.write(changes, live.layouts())
        deltas.append((p.peak, p.seconds, len(changes["t"].rows)))
        del changes
    out.update(
        delta_rows=int(np.mean([d[2] for d in deltas])),
        delta_peak_mb=round(max(d[0] for d in deltas), 1),
        delta_s=round(float(np.mean([d[1] for d in deltas])), 3),
    )
    chain = RowChain(Path(tmp), names, sums)
    with Peak() as p:
        row_format.compact(Path(tmp), chain, 0, 1, 999)
    out.update(merge_peak_mb=round(p.peak, 1), merge_s=round(p.seconds, 2))
    del live
    back = tables()
    with Peak() as p:
        RowChain(Path(tmp), names, sums).restore(back)
    out.update(restore_peak_mb=round(p.peak, 1), restore_s=round(p.seconds, 2))
    out["restored_rows"] = back.table("t").held
print(json.dumps(out))
