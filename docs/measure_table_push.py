"""A server's table work per push, without the wire or the workers: the pushes of
``bench sparse``'s (a) run (1M x 64 table, the row optimizer --optimizer adam gives: lazy
adam until issue 44 made it sparse-adam; batch 256 of the click log, one epoch) replayed against one shard's ``TableSet``: a row pull's lookup and initial values,
``check`` (outside the coordinator's lock: it computes a push's new rows' initial values)
and ``apply`` (under it); ms per push each. Issue 27's note quotes it: run it at two
commits (``PYTHONPATH=<a checkout>``) to compare them.

Run: .venv/bin/python docs/measure_table_push.py
"""

import time

import numpy as np
import torch

from paramserver.codec.rows import RowGradients, TableSpec
from paramserver.sparse.tableset import TableSet, row_optimizer
from paramserver.training import clicks

torch.set_num_threads(1)
tables = TableSet([TableSpec("tables.0", 1_000_000, 64)], row_optimizer("adam", 0.01))
x, _, _, _ = clicks.make(200_000, 10, seed=0, fields=8, rows=125_000)
ids_all = (x + torch.arange(8) * 125_000).numpy()
grads = torch.randn(4096, 64)
took = {"pull": 0.0, "check": 0.0, "apply": 0.0}
n = 0
for lo in range(0, 200_000 - 256, 256):
    ids = np.unique(ids_all[lo : lo + 256].ravel())
    t0 = time.perf_counter()
    rows = [f.complete() for f in tables.lookup_many([("tables.0", ids)])]
    t1 = time.perf_counter()
    checked = tables.check([RowGradients("tables.0", ids, grads[: len(ids)])])
    t2 = time.perf_counter()
    tables.apply(checked, 0.01, n + 1)
    t3 = time.perf_counter()
    took["pull"] += t1 - t0
    took["check"] += t2 - t1
    took["apply"] += t3 - t2
    n += 1
print(
    ", ".join(f"{k} {1e3 * v / n:.3f} ms" for k, v in took.items()), f"a push; {tables.held} rows"
)
