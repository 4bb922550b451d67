"""A server's table work per push on ``bench sparse``'s Criteo case, without the wire or the
workers: the pushes of a (h) worker (26 tables of the Criteo Kaggle cardinalities x 16,
lazy adam, batch 1024 of the Criteo-like stream) replayed against one shard's
``TableSet``: a row pull's lookup and initial values, ``check`` (outside the coordinator's
lock) and ``apply`` (under it), ms per push each, with every table on the hashed index
(as before issue 44's index by id) and as the server builds them now; then the same rows
as ONE table (the rows a push holds, in one call) to split the per-table cost from the
per-row cost.
Issue 28's note quotes it.

Run: .venv/bin/python docs/measure_criteo_push.py
"""

import time

import numpy as np
import torch

from paramserver.bench.criteo.stream import CARDINALITIES, DENSE, make
from paramserver.codec.rows import RowGradients, TableSpec
from paramserver.sparse import table
from paramserver.sparse.index import RowIndex, index_for
from paramserver.sparse.tableset import TableSet, row_optimizer

torch.set_num_threads(1)
BATCH, STEPS, DIM = 1024, 120, 16
x, _, _, _ = make(BATCH * STEPS, 10)
ids_all = x[:, DENSE:].numpy() % np.array(CARDINALITIES)


def replay(specs: list[TableSpec], pushes: list[list[tuple[str, np.ndarray]]]) -> dict[str, float]:
    tables = TableSet(specs, row_optimizer("adam", 0.01))
    took = {"pull": 0.0, "check": 0.0, "apply": 0.0}
    for n, push in enumerate(pushes):
        t0 = time.perf_counter()
        [f.complete() for f in tables.lookup_many(push)]
        t1 = time.perf_counter()
        grads = [RowGradients(name, ids, torch.randn(len(ids), DIM)) for name, ids in push]
        t2 = time.perf_counter()
        checked = tables.check(grads)
        t3 = time.perf_counter()
        tables.apply(checked, 0.01, n + 1)
        t4 = time.perf_counter()
        if n >= 20:  # past the first pushes, which create most rows
            took["pull"] += t1 - t0
            took["check"] += t3 - t2
            took["apply"] += t4 - t3
    return {k: 1e3 * v / (len(pushes) - 20) for k, v in took.items()}


many = [TableSpec(f"t{f}", c, DIM) for f, c in enumerate(CARDINALITIES)]
one = [TableSpec("all", sum(CARDINALITIES), DIM)]
offsets = np.concatenate([[0], np.cumsum(CARDINALITIES)[:-1]])
pushes_many, pushes_one = [], []
rows = 0
for s in range(STEPS):
    batch = ids_all[s * BATCH : (s + 1) * BATCH]
    per = [(f"t{f}", np.unique(batch[:, f])) for f in range(len(CARDINALITIES))]
    pushes_many.append(per)
    pushes_one.append([("all", np.concatenate([ids + offsets[f] for f, (_, ids) in enumerate(per)]))])
    rows += sum(len(ids) for _, ids in per)
print(f"{rows / STEPS:,.0f} distinct rows a push")
for label, specs, pushes in (
    ("26 tables, hashed index", many, pushes_many),
    ("26 tables", many, pushes_many),
    ("one table", one, pushes_one),
):
    # "hashed index": every table on the hashed RowIndex, as before the index by id
    hashed = label.endswith("hashed index")
    table.index_for = (lambda rows, bounded, reserve=1024: RowIndex(reserve)) if hashed else index_for
    took = replay(specs, pushes)
    total = sum(took.values())
    print(f"{label}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in took.items()) + f" a push, {total:.2f} ms in all")
