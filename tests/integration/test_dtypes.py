"""Models whose parameters are float16, bfloat16 or float64 train: the server keeps float32
master weights and optimizer state (float64 for a float64 model), workers get the weights in
their own dtype and push gradients in it; torch.autocast works unchanged; non-floating
parameters are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from paramserver.errors import ConfigError
from paramserver.training import data
from tests.conftest import WorkerThread, replica, tiny_model

BATCH, STEPS = 32, 60


def _train(server: ps.ServerApp, model: nn.Module, ds: data.Dataset, autocast: bool) -> list:
    losses = []
    with ps.Worker(server.address, model, train_samples=len(ds.train_x)) as w:
        for _ in range(STEPS):
            idx = data.batch_indices(len(ds.train_x), 0, BATCH, w.batch)
            x = ds.train_x[idx].to(next(model.parameters()).dtype)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(model(x).float(), ds.train_y[idx])
            loss.backward()
            losses.append(loss.item())
            w.step(samples=len(idx))
        codec = w._codec.dtype
    return [losses, codec]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_trains_against_float32_master_weights(serve, dtype):
    ds = data.synthetic(train=2 * BATCH * STEPS, test=16)
    model = tiny_model().to(dtype)
    server = serve(
        replica(model),
        optimizer="adam",
        lr=3e-3,
        policy="sync",
        workers=2,
        dataset="synthetic",
        batch_size=BATCH,
    )
    locals_ = [replica(model) for _ in range(2)]
    threads = [WorkerThread(lambda m=m: _train(server, m, ds, False)) for m in locals_]
    for t in threads:
        t.start()
    results = [t.result() for t in threads]
    for (losses, codec), local in zip(results, locals_, strict=True):
        assert codec == str(dtype)[6:]  # gradients crossed the wire in the model's dtype
        assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10]), losses
        assert all(p.dtype == dtype for p in local.parameters())
    master = server.coordinator.store.weights
    assert master.dtype == np.float32
    rounded = torch.from_numpy(master.copy()).to(dtype).float().numpy()
    assert (master != rounded).any()  # the master keeps more than the model's 16 bits
    # and every worker holds the master rounded to its dtype
    flat = torch.cat([p.detach().float().reshape(-1) for p in locals_[0].parameters()])
    assert np.array_equal(flat.numpy(), rounded)


def test_autocast_works_unchanged(serve):
    ds = data.synthetic(train=BATCH * STEPS, test=16)
    model = tiny_model()
    server = serve(
        replica(model),
        optimizer="adam",
        lr=3e-3,
        policy="async",
        workers=1,
        dataset="synthetic",
        batch_size=BATCH,
    )
    losses, codec = _train(server, replica(model), ds, autocast=True)
    assert codec == "float32" and np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10])


@pytest.mark.parametrize("shm", [True, False])
def test_a_float64_model_trains_against_float64_master_weights(serve, shm):
    ds = data.synthetic(train=BATCH * STEPS, test=16)
    model = tiny_model().double()
    server = serve(
        replica(model),
        optimizer="sgd",
        lr=0.1,
        policy="sync",
        workers=1,
        dataset="synthetic",
        batch_size=BATCH,
        shards=1,
    )
    local, ref = replica(model), replica(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with ps.Worker(server.address, local, train_samples=len(ds.train_x), shm=shm) as w:
        assert w.shm_active is shm and w._codec.dtype == "float64"
        for _ in range(10):
            idx = data.batch_indices(len(ds.train_x), 0, BATCH, w.batch)
            x, y = ds.train_x[idx].double(), ds.train_y[idx]
            F.cross_entropy(local(x), y).backward()
            w.step(samples=len(idx))
            opt.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            opt.step()
    assert server.coordinator.store.weights.dtype == np.float64
    # float64 end to end: the same steps as a local float64 SGD, to float64 precision
    for a, b in zip(local.parameters(), ref.parameters(), strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_non_floating_parameters_are_refused_naming_them(serve):
    model = tiny_model()
    model.register_parameter(
        "steps", nn.Parameter(torch.zeros(1, dtype=torch.int64), requires_grad=False)
    )
    with pytest.raises(ConfigError, match="Parameter 'steps' has dtype int64"):
        serve(model)
