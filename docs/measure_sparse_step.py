"""Where a sparse step's time goes, without the wire: the built-in DLRM with its 8 tables
sparse (10,000 x 16 each), batch 256 of the click log, its tables in this process
(``LocalTables``, lazy adam) and its dense part under torch's Adam; ms per step, then a
cProfile of 100 steps. Issue 12's note quotes it.

Run: .venv/bin/python docs/measure_sparse_step.py
"""

import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

from paramserver import models
from paramserver.sparse.client import LocalTables
from paramserver.sparse.embedding import attach_tables, table_specs
from paramserver.sparse.table import ShardTable
from paramserver.sparse.tableset import row_optimizer
from paramserver.training import clicks


def main() -> None:
    torch.set_num_threads(1)
    train_x, train_y, _, _ = clicks.make(train=60_000, test=10)
    model = models.DLRM(clicks.FIELDS, clicks.ROWS, sparse=True)
    specs = table_specs(model)
    tables = LocalTables({s.name: [ShardTable(s, row_optimizer("adam", 0.01))] for s in specs})
    attached = attach_tables(model, tables)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def run(steps: int) -> None:
        for i in range(steps):
            x, y = train_x[i * 256 : (i + 1) * 256], train_y[i * 256 : (i + 1) * 256]
            F.cross_entropy(model(x), y).backward()
            for table in attached.values():
                table.push()
            opt.step()
            opt.zero_grad()

    run(20)
    t0 = time.perf_counter()
    run(100)
    print(f"{(time.perf_counter() - t0) * 10:.2f} ms a step")
    profile = cProfile.Profile()
    profile.runcall(run, 100)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(20)


if __name__ == "__main__":
    main()
