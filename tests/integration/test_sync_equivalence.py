"""sync with N workers of batch b == one process with batch N*b, step for step."""

from __future__ import annotations

import pytest
import torch

import paramserver as ps
from paramserver.training import data
from tests.conftest import large_batch_reference, replica, sync_workers, tiny_model

BATCH, STEPS, WORKERS = 16, 12, 2


def _batch(ds: data.Dataset, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = data.batch_indices(len(ds.train_x), 0, BATCH, batch)
    return ds.train_x[idx], ds.train_y[idx]


@pytest.mark.parametrize(
    "optimizer,lr,flat",
    [("sgd", 0.1, False), ("momentum", 0.05, False), ("adam", 1e-3, False), ("adam", 1e-3, True)],
)
def test_two_sync_workers_match_one_large_batch_process(serve, optimizer, lr, flat):
    """flat: the workers keep the model in flat tensors, gradients copied out in buckets
    during backward (a CUDA worker's default; ``worker/flat.py``)."""
    ds = data.synthetic(train=1024, test=16)
    model = tiny_model()
    server = serve(
        replica(model),
        optimizer=optimizer,
        lr=lr,
        policy="sync",
        workers=WORKERS,
        dataset="synthetic",
        batch_size=BATCH,
    )

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _batch(ds, b)

    results = sync_workers(server.address, model, batch, STEPS, WORKERS, len(ds.train_x), flat=flat)
    # The reference: one process, batch 2b made of the round's two batches, same optimizer.
    ref = large_batch_reference(
        model,
        lambda p: ps.store.build_optimizer(p, ps.OptimizerConfig(optimizer, lr)),
        batch,
        STEPS,
        WORKERS,
    )

    assert server.status()["version"] == STEPS
    for name, expected in ref.state_dict().items():
        for got in results:
            torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-6)
    # and the weights really moved, so the comparison means something
    assert not torch.allclose(ref.state_dict()["1.weight"], model.state_dict()["1.weight"])
