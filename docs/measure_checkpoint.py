"""How long a server checkpoint of a 67 MiB model takes, and how long it holds the lock.

Run: .venv/bin/python docs/measure_checkpoint.py
"""

import os
import tempfile
import time

import numpy as np
import torch

from paramserver.codec import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.server.disk.checkpoint_writer import Checkpointer
from paramserver.server.engine.coordinator import Coordinator
from paramserver.server.bookkeeping.store import ParameterStore


def main() -> None:
    n = 67 * 2**20 // 4
    manifest = Manifest.from_tensors([("w", torch.zeros(n))])
    for opt in ("sgd", "adam"):
        store = ParameterStore(manifest, np.zeros(n, np.float32), OptimizerConfig(opt))
        store.apply(np.ones(n, np.float32))
        c = Coordinator(ServerConfig(optimizer=OptimizerConfig(opt)), store)
        with tempfile.TemporaryDirectory(dir="/tmp") as d:
            ck = Checkpointer(c, d, "60s")
            t0 = time.perf_counter()
            c.checkpoint_state()  # what runs under the server's lock
            t1 = time.perf_counter()
            ck.save()  # the whole save: copy, serialise, write, fsync, rename
            t2 = time.perf_counter()
            size = os.path.getsize(f"{d}/server-checkpoint.pt")
            print(f"{opt}: lock held {1000 * (t1 - t0):.0f} ms (copy), full save {t2 - t1:.2f} s, "
                  f"file {size / 2**20:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
