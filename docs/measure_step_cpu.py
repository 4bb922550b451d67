"""The CPU a daemon worker's step costs on each side: one worker (``async``, MLP, batch 64,
synthetic data, 3,000 steps) against a server child; the worker's CPU from
``time.process_time()``, the server's from ``/proc`` (``bench.common.cpu_seconds``).
docs/BENCHMARKS.md ("Where the time goes") quotes it.

Run: .venv/bin/python docs/measure_step_cpu.py on        (the control socket)
     .venv/bin/python docs/measure_step_cpu.py payloads  (gRPC control)
"""

import logging
import sys
import time

import torch

from paramserver.bench.common import cpu_seconds, server_child
from paramserver.config import OptimizerConfig, ServerConfig, WorkerConfig
from paramserver.training.trainer import run

STEPS = 3000


def main(shm: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    cfg = ServerConfig(model="mlp", optimizer=OptimizerConfig("adam"), policy="async",
                       workers=1, dataset="synthetic", batch_size=64, epochs=100000,
                       lease_seconds=30)  # fmt: skip
    with server_child(cfg) as (address, child):
        worker = WorkerConfig(address, device="cpu", threads=1, name="w0", max_steps=STEPS,
                              shm=shm)  # fmt: skip
        s0, t0, c0 = cpu_seconds(child.proc.pid), time.perf_counter(), time.process_time()
        run(worker)
        t1, c1, s1 = time.perf_counter(), time.process_time(), cpu_seconds(child.proc.pid)
    print(f"--shm {shm}: per step, wall {1e3 * (t1 - t0) / STEPS:.3f} ms, worker CPU "
          f"{1e3 * (c1 - c0) / STEPS:.3f} ms, server CPU {1e3 * (s1 - s0) / STEPS:.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "on")
