"""Where a worker's step goes (issue 44): ``bench sparse``'s (a) run, the 1M-row DLRM, 2
async workers against a server in this process; rank 0 under cProfile (its own process,
its main thread, wall time), rank 1 plain. Prints each rank's steps, seconds and CPU
seconds (every thread), then rank 0's profile.

Run: .venv/bin/python docs/measure_worker_profile.py
"""

import json
import logging
import pstats
import tempfile
from pathlib import Path

import torch
from measure_server_profile import case, run  # this folder's: the same run

from paramserver.bench.tables.ranks import data

logging.getLogger("paramserver").setLevel(logging.WARNING)
with tempfile.TemporaryDirectory() as d:
    d = Path(d)
    saved = d / "train.pt"
    torch.save(data(case)[:2], saved)
    run(d, saved, profile=d / "prof0")
    for rank in range(2):
        r = json.loads((d / f"out{rank}.json").read_text())
        print(rank, {k: r[k] for k in ("steps", "seconds", "cpu_seconds")})
    st = pstats.Stats(str(d / "prof0"))
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumtime").print_stats(
        "ps_main|step|forward|backward|rows_of|_fetch|stage|push_pull|pull_rows|prefetch|_load|load|retrying|coalesce|gradients",
        40,
    )
