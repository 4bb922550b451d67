"""sync with N workers of batch b == one process with batch N*b, step for step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver import data
from tests.conftest import WorkerThread, replica, tiny_model

BATCH, STEPS, WORKERS = 16, 12, 2


def _batch(ds: data.Dataset, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = data.batch_indices(len(ds.train_x), 0, BATCH, batch)
    return ds.train_x[idx], ds.train_y[idx]


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("momentum", 0.05), ("adam", 1e-3)])
def test_two_sync_workers_match_one_large_batch_process(serve, optimizer, lr):
    ds = data.synthetic(train=1024, test=16)
    model = tiny_model()
    server = serve(
        replica(model), optimizer=optimizer, lr=lr, policy="sync", workers=WORKERS,
        dataset="synthetic", batch_size=BATCH,
    )  # fmt: skip

    def train() -> dict[str, torch.Tensor]:
        local = replica(model)
        with ps.Worker(server.address, local, train_samples=len(ds.train_x)) as w:
            for _ in range(STEPS):
                assert w.batch is not None
                x, y = _batch(ds, w.batch)
                F.cross_entropy(local(x), y).backward()
                w.step(samples=len(x))
        return {k: v.clone() for k, v in local.state_dict().items()}

    threads = [WorkerThread(train, f"worker-{i}") for i in range(WORKERS)]
    for t in threads:
        t.start()
    results = [t.result() for t in threads]

    # The reference: one process, batch 2b made of the round's two batches (the server hands
    # out batches in order, so round t is batches 2t and 2t+1), same optimizer.
    ref = replica(model)
    opt = ps.store.build_optimizer(list(ref.parameters()), ps.OptimizerConfig(optimizer, lr))
    for step in range(STEPS):
        xs, ys = zip(*(_batch(ds, WORKERS * step + r) for r in range(WORKERS)), strict=True)
        opt.zero_grad()
        F.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()

    assert server.status()["version"] == STEPS
    for name, expected in ref.state_dict().items():
        for got in results:
            torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-6)
    # and the weights really moved, so the comparison means something
    assert not torch.allclose(ref.state_dict()["1.weight"], model.state_dict()["1.weight"])
