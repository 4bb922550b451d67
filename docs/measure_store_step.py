"""The server's optimizer step on the default MLP's flat parameters (235,146 float32, Adam,
one torch thread): ``ParameterStore.apply`` through torch's ``optimizer.step()`` wrapper
(a profiler range and the step hooks) against the bare step (``config/lazy_dynamo.bare_step``), ms a
step, alternating, medians of 5 rounds of 2,000 steps. Issue 26's note quotes it.

Run: .venv/bin/python docs/measure_store_step.py
"""

import statistics
import time

import numpy as np
import torch

from paramserver import models
from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig
from paramserver.server.bookkeeping.store import ParameterStore

torch.set_num_threads(1)
model = models.resolve("mlp")()
manifest = Manifest.from_tensors(models.parameters(model))
initial = np.zeros(manifest.numel, np.float32)
grad = np.random.default_rng(0).standard_normal(manifest.section("param")[1]).astype(np.float32)
took: dict[str, list[float]] = {"optimizer.step()": [], "bare step": []}
for _ in range(5):
    for label in took:
        store = ParameterStore(manifest, initial, OptimizerConfig("adam", lr=1e-3))
        if label == "optimizer.step()":
            store._bare_step = None
        for _ in range(200):
            store.apply(grad)
        t0 = time.perf_counter()
        for _ in range(2000):
            store.apply(grad)
        took[label].append((time.perf_counter() - t0) / 2000 * 1e3)
print(", ".join(f"{k} {statistics.median(v):.3f} ms" for k, v in took.items()), "a step")
