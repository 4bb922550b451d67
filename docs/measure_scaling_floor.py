"""The least CPU a step of ``bench scaling``'s MLP can cost in this design, from its parts
measured alone, and the best ``2 workers / one local one-thread process`` that leaves on a
2-core machine (issue 26, must 5: target 1.3).

Each part runs in a hot loop on one torch thread, so each is a floor: under the cluster's
load the same passes run on colder caches, beside other processes. Parts (the MLP,
235,146 float32, batch 64, Adam):
- local step: zero_grad, forward, loss, backward, Adam step (what one local process does);
- worker compute: the same without the optimizer step (a worker's share of it);
- the bytes the design moves a step: the worker's gradient into its shared-memory slot, the
  server's copy of it out with the finiteness check folded in (the trust boundary: a worker
  cannot change what the server steps on), the copy of the version the apply replaces for
  pulls that come meanwhile (must 4), the server's write of the weights into the worker's
  segment, and the worker's copy of them into its model;
- the server's Adam step (``ParameterStore.apply``, the bare fused step).

The floor of a step's CPU is their sum; on 2 cores, perfectly packed, a step takes half of
it, so the best ratio is 2 x local step / floor. The script prints it with and without the
copies, medians of 5 rounds.

Run: .venv/bin/python docs/measure_scaling_floor.py
"""

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from paramserver import models
from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig
from paramserver.server.engine.checks import Scan
from paramserver.server.bookkeeping.store import ParameterStore, build_optimizer
from paramserver.transport.segment_io import copy_split

torch.set_num_threads(1)
BATCH, REPS, ROUNDS = 64, 2000, 5


def ms(f: Callable[[], object]) -> float:
    """Median over ``ROUNDS`` of the mean ms of ``f`` over ``REPS`` calls."""
    for _ in range(200):
        f()
    took = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(REPS):
            f()
        took.append((time.perf_counter() - t0) / REPS * 1e3)
    return statistics.median(took)


model = models.resolve("mlp")()
params = list(model.parameters())
x = torch.randn(BATCH, 1, 28, 28)
y = torch.randint(0, 10, (BATCH,))
adam = build_optimizer(params, OptimizerConfig("adam"))  # as bench scaling's local step


def backward() -> None:
    adam.zero_grad()
    F.cross_entropy(model(x), y).backward()


def local_step() -> None:
    backward()
    adam.step()


manifest = Manifest.from_tensors(models.parameters(model))
n = manifest.numel
store = ParameterStore(manifest, np.zeros(n, np.float32), OptimizerConfig("adam", lr=1e-3))
grad = np.random.default_rng(0).standard_normal(n).astype(np.float32)
slot = np.empty(n, np.float32)  # stands for the worker's slot and weights region
into = np.empty(n, np.float32)
snap = np.empty(n, np.float32)
mapping = bytearray(slot.nbytes)  # copy_split reads a buffer; an mmap in the server
flat_grads = torch.empty(n)


def grads_to_slot() -> None:
    torch.cat([p.grad.reshape(-1) for p in params], out=flat_grads)
    np.copyto(slot, flat_grads.numpy())


def server_copy_and_check() -> None:
    copy_split(into.data.cast("B"), mapping, 0, Scan(np.dtype(np.float32)))  # type: ignore[arg-type]


def weights_to_model() -> None:
    offset = 0
    src = torch.from_numpy(slot)
    with torch.no_grad():
        for p in params:
            p.copy_(src[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


parts = {
    "local step": ms(local_step),
    "worker compute (forward, backward)": ms(backward),
    "worker: gradients into its slot": ms(grads_to_slot),
    "server: gradient out of the slot, checked": ms(server_copy_and_check),
    "server: Adam step": ms(lambda: store.apply(grad)),
    "server: copy of the replaced version (must 4)": ms(lambda: np.copyto(snap, into)),
    "server: weights into the worker's segment": ms(lambda: np.copyto(slot, into)),
    "worker: weights into its model": ms(weights_to_model),
}
for name, t in parts.items():
    print(f"{name:48s} {t:.3f} ms")
local = parts.pop("local step")
compute_only = parts["worker compute (forward, backward)"] + parts["server: Adam step"]
floor = sum(parts.values())
print(f"floor of a step, compute only: {compute_only:.3f} ms -> best 2 workers "
      f"{2 * local / compute_only:.2f} x local")  # fmt: skip
print(f"floor of a step, with the copies: {floor:.3f} ms -> best 2 workers "
      f"{2 * local / floor:.2f} x local")  # fmt: skip
