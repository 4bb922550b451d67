"""``bench sparse``'s memory per row: what a shard's resident memory grows by for each row it
holds, with lazy adam at dim 16 (the row's values and optimizer state are 16 + 2 * 16
floats and one int64 step count: 200 bytes).

``python -m paramserver.bench.tables.row_memory N`` (a fresh process, so nothing else moves its
memory) creates N rows of an unbounded table through pushes of 65,536 rows, as a shard
does (``ShardTable``), and prints one JSON line: rows, the growth of VmRSS, bytes per row,
the state's bytes per row, and the table's own count of its bytes (storage and index).
"""

from __future__ import annotations

import gc
import json
import sys

import numpy as np
import torch

from paramserver.bench.ddp import peak_rss_mb
from paramserver.codec.rows import TableSpec
from paramserver.sparse.memory import fix_mmap_threshold
from paramserver.sparse.optim import RowOptimizerConfig
from paramserver.sparse.table import ShardTable

DIM, PUSH = 16, 1 << 16
STATE_BYTES = DIM * 4 * 3 + 8  # values, adam's two moments, the row's step count


def measure(rows: int) -> dict[str, float]:
    torch.set_num_threads(1)
    fix_mmap_threshold()  # as a server with tables does
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(-(2**62), 2**62, int(rows * 1.01)))[:rows]
    rng.shuffle(ids)
    grads = torch.randn(PUSH, DIM)
    table = ShardTable(TableSpec("t", 0, DIM), RowOptimizerConfig("adam", 0.01))
    gc.collect()
    before = peak_rss_mb("VmRSS")
    for step, lo in enumerate(range(0, rows, PUSH), start=1):
        part = ids[lo : lo + PUSH]
        table.push(part, grads[: len(part)], step)
    gc.collect()
    grown = peak_rss_mb("VmRSS") - before
    return {
        "rows": table.held,
        "rss_growth_mb": grown,
        "bytes_per_row": grown * 2**20 / table.held,
        "state_bytes_per_row": STATE_BYTES,
        "table_bytes_per_row": table.nbytes() / table.held,
    }


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]))))
