"""sync with N workers of batch b == one process with batch N*b, step for step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver import data
from tests.conftest import WorkerThread, replica, tiny_model

BATCH, STEPS, WORKERS = 16, 12, 2


def _shard_batch(ds: data.Dataset, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = data.shard_indices(len(ds.train_x), 0, 0, rank, WORKERS, BATCH)[
        step * BATCH : (step + 1) * BATCH
    ]
    return ds.train_x[idx], ds.train_y[idx]


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("momentum", 0.05), ("adam", 1e-3)])
def test_two_sync_workers_match_one_large_batch_process(serve, optimizer, lr):
    ds = data.synthetic(train=1024, test=16)
    model = tiny_model()
    server = serve(replica(model), optimizer=optimizer, lr=lr, policy="sync", workers=WORKERS)

    def train() -> dict[str, torch.Tensor]:
        local = replica(model)
        with ps.Worker(server.address, local) as w:
            for step in range(STEPS):
                x, y = _shard_batch(ds, w.rank, step)
                F.cross_entropy(local(x), y).backward()
                w.step(samples=len(x))
        return {k: v.clone() for k, v in local.state_dict().items()}

    threads = [WorkerThread(train, f"worker-{i}") for i in range(WORKERS)]
    for t in threads:
        t.start()
    results = [t.result() for t in threads]

    # The reference: one process, batch 2b made of both shards' batches, same optimizer.
    ref = replica(model)
    opt = ps.store.build_optimizer(list(ref.parameters()), ps.OptimizerConfig(optimizer, lr))
    for step in range(STEPS):
        xs, ys = zip(*(_shard_batch(ds, r, step) for r in range(WORKERS)), strict=True)
        opt.zero_grad()
        F.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()

    assert server.status()["version"] == STEPS
    for name, expected in ref.state_dict().items():
        for got in results:
            torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-6)
    # and the weights really moved, so the comparison means something
    assert not torch.allclose(ref.state_dict()["1.weight"], model.state_dict()["1.weight"])
