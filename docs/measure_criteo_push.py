"""A server's table work per push on ``bench sparse``'s Criteo case, without the wire or the
workers (``paramserver.bench.criteo.push_time``, whose total ``bench sparse`` reports as
``criteo_push_server_ms``): the pushes of a (h) worker (26 tables of the Criteo Kaggle
cardinalities x 16, the full case's, its row optimizer, batch 1024 of the Criteo-like stream) replayed against
one shard's ``TableSet``, ms per push of a row pull's lookup and initial values, ``check``
(outside the coordinator's lock) and ``apply`` (under it): with every table on the hashed
index (as before issue 44's index by id) and as the server builds them now; then the same
rows as ONE table (the rows a push holds, in one call) to split the per-table cost from the
per-row cost.

Run: .venv/bin/python docs/measure_criteo_push.py
"""

import numpy as np

from paramserver.bench.criteo import push_time
from paramserver.bench.criteo.stream import CARDINALITIES
from paramserver.codec.rows import TableSpec
from paramserver.sparse import table
from paramserver.sparse.index import RowIndex, index_for

BATCH, STEPS, DIM = 1024, 120, push_time.DIM
cards = CARDINALITIES
pushes_many = push_time.pushes(cards, BATCH, STEPS)
offsets = np.concatenate([[0], np.cumsum(cards)[:-1]])
pushes_one = [
    [("all", np.concatenate([ids + offsets[f] for f, (_, ids) in enumerate(push)]))]
    for push in pushes_many
]
many = [TableSpec(f"t{f}", c, DIM) for f, c in enumerate(cards)]
one = [TableSpec("all", sum(cards), DIM)]
rows = sum(len(ids) for push in pushes_many for _, ids in push) / STEPS
print(f"{rows:,.0f} distinct rows a push ({len(cards)} tables)")
for label, specs, pushes in (
    ("26 tables, hashed index", many, pushes_many),
    ("26 tables", many, pushes_many),
    ("one table", one, pushes_one),
):
    hashed = label.endswith("hashed index")
    table.index_for = (lambda r, bounded, reserve=1024: RowIndex(reserve)) if hashed else index_for
    took = push_time.replay(specs, pushes)
    parts = ", ".join(f"{k} {took[k]:.2f} ms" for k in ("pull", "check", "apply"))
    print(f"{label}: {parts} a push, {took['total']:.2f} ms in all")
