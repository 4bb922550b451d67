"""A shard's optimizer without torch._dynamo (``config/lazy_dynamo.py`` and the store's
bare step): none is imported by a server and a worker training, and code that compiles
still sees torch's optimizer methods as torch wraps them."""

from __future__ import annotations

import subprocess
import sys

import torch

from paramserver.config import lazy_dynamo

FRESH = """
import sys
import numpy as np
import torch
import torch.nn.functional as F
import paramserver as ps
from paramserver import models
from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.training import data

manifest = Manifest.from_tensors([("w", torch.zeros(2, 3)), ("b", torch.zeros(2))])
for name in ("sgd", "momentum", "nesterov", "delayed-nesterov", "adam", "adamw"):
    store = ParameterStore(manifest, np.ones(manifest.numel, np.float32), OptimizerConfig(name))
    for _ in range(2):
        store.apply(np.ones(manifest.numel, np.float32))
    opt = store.optimizer
    opt.load_state_dict(opt.state_dict())
    opt.zero_grad()
from paramserver.config import lazy_dynamo
p = torch.nn.Parameter(torch.ones(3))
inner = torch.optim.AdamW([p], lr=0.1)  # the worker daemon's inner optimizer (local steps)
step = lazy_dynamo.stepper(inner)
for _ in range(2):
    p.grad = torch.ones(3)
    step()
    inner.zero_grad()
server = ps.serve("mlp", port=0, policy="sync", workers=1)
model = models.resolve("mlp")()
ds = data.synthetic(train=64, test=16)
with ps.Worker(server.address, model) as w:
    for step in range(3):
        idx = data.batch_indices(len(ds.train_x), 0, 16, step)
        F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx]).backward()
        w.step(samples=len(idx))
    version = server.status()["version"]
server.stop(grace=0)
print("version", version, "dynamo", "torch._dynamo" in sys.modules)
"""


def test_a_server_and_a_worker_train_without_torchs_compiler():
    """Every optimizer the server offers is built, steps, saves, loads and zeroes, and a
    sync run of 3 steps trains, in a process that never imports torch._dynamo: it cost
    2.2-2.4 s of CPU at each server's start, on the 2-core machine, for the first
    optimizer's ``add_param_group`` (and 2 s more at its first step, for the grad-mode
    wrapper's graph breaks)."""
    out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "version 3 dynamo False" in out.stdout, out.stdout + out.stderr[-3000:]


def test_the_stepper_is_the_optimizer_s_step_and_runs_hooks_registered_later():
    """The inner optimizer's bare step (``stepper``) gives optimizer.step()'s weights and
    state bit for bit; a hook registered after it was made still runs."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    seen: list[str] = []
    for kind in (torch.optim.AdamW, torch.optim.SGD):
        params = [torch.nn.Parameter(torch.linspace(-1, 1, 5)) for _ in range(2)]
        opts = [kind([p], lr=0.1) for p in params]
        steps = [lazy_dynamo.stepper(opts[0]), opts[1].step]
        for i in range(3):
            for p, step in zip(params, steps, strict=True):
                p.grad = torch.full((5,), float(i) - 0.5)
                step()
        assert torch.equal(params[0], params[1]), kind
        mine, theirs = (o.state_dict()["state"] for o in opts)  # plain SGD keeps none
        assert mine.keys() == theirs.keys() == ({0} if kind is torch.optim.AdamW else set())
        for k in mine:
            assert mine[k].keys() == theirs[k].keys()
            assert all(torch.equal(mine[k][n], theirs[k][n]) for n in mine[k]), kind
        handle = register_optimizer_step_post_hook(lambda opt, *_: seen.append("hook"))
        try:
            steps[0]()
        finally:
            handle.remove()
    assert seen == ["hook", "hook"]


def test_a_compiled_function_calls_the_optimizer_as_eager_mode_does():
    """Once torch._dynamo is imported (``torch.compile``), the deferred methods run with
    dynamo off, as torch's own wrapper runs them: a compiled step, zero_grad and
    state_dict give what eager mode gives."""
    lazy_dynamo.install()

    def run(compiled: bool) -> tuple[torch.Tensor, int]:
        p = torch.nn.Parameter(torch.arange(4.0))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)

        def step(x: torch.Tensor) -> int:
            opt.zero_grad()
            (p * x).sum().backward()
            opt.step()
            return len(opt.state_dict()["state"])

        fn = torch.compile(step, backend="eager") if compiled else step
        kept = [fn(torch.full((4,), float(i))) for i in range(3)]
        return p.detach().clone(), kept[-1]

    eager, compiled = run(False), run(True)
    assert torch.equal(eager[0], compiled[0]) and eager[1] == compiled[1] == 1
    assert "torch._dynamo" in sys.modules


def test_a_torch_whose_wrapper_differs_is_left_as_it_is(monkeypatch):
    """A method that is not torch's lazy wrapper (another torch) is not touched."""

    def plain(self, *args, **kwargs):
        return None

    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", plain)
    lazy_dynamo.install()
    assert torch.optim.Optimizer.zero_grad is plain and not hasattr(plain, "__dynamo_disable")
