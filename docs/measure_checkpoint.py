"""How long a server checkpoint of a 67 MiB model takes, and how long it holds the lock.

Run: .venv/bin/python docs/measure_checkpoint.py
"""

import time, tempfile, torch, numpy as np
from paramserver.codec import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.store import ParameterStore
from paramserver.server.coordinator import Coordinator
from paramserver.server.checkpointer import Checkpointer

n = 67 * 2**20 // 4
m = Manifest.from_tensors([("w", torch.zeros(n))])
for opt in ("sgd", "adam"):
    store = ParameterStore(m, np.zeros(n, np.float32), OptimizerConfig(opt))
    store.apply(np.ones(n, np.float32))
    c = Coordinator(ServerConfig(optimizer=OptimizerConfig(opt)), store)
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        ck = Checkpointer(c, d, "60s")
        t = time.perf_counter()
        state = c.checkpoint_state()
        t1 = time.perf_counter()
        ck.save()
        t2 = time.perf_counter()
        import os

        size = os.path.getsize(f"{d}/server-checkpoint.pt")
        print(
            f"{opt}: lock held {1000 * (t1 - t):.0f} ms (copy), full save {t2 - t1:.2f} s, file {size / 2**20:.0f} MiB"
        )
