"""A BatchNorm model trained by 2 sync workers through the Python API: the server's state
(parameters and buffers) loads strictly into a fresh replica and evaluates close to the same
model trained locally with the doubled batch. Before buffers crossed the wire its running
mean stayed at zero, and in eval mode it scored 26% against 44% locally."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from paramserver.codec import layout
from paramserver.server.disk import checkpoint
from paramserver.training import data
from tests.conftest import large_batch_reference, replica, sync_workers

BATCH, STEPS, WORKERS, SHIFT = 32, 40, 2, 3.0


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 14 * 14, 10),
    )


def _batch(ds: data.Dataset, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = data.batch_indices(len(ds.train_x), 0, BATCH, b)
    return ds.train_x[idx] + SHIFT, ds.train_y[idx]  # a data mean far from 0


def _accuracy(model: nn.Module, ds: data.Dataset) -> float:
    model.eval()
    with torch.no_grad():
        return (model(ds.test_x + SHIFT).argmax(1) == ds.test_y).float().mean().item()


@pytest.mark.parametrize("flat", [False, True])
def test_sync_workers_share_batchnorm_statistics(serve, flat):
    ds = data.synthetic(train=WORKERS * BATCH * STEPS, test=512)
    model = bn_model()
    server = serve(
        replica(model),
        optimizer="sgd",
        lr=0.05,
        policy="sync",
        workers=WORKERS,
        dataset="synthetic",
        batch_size=BATCH,
    )

    def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _batch(ds, b)

    finals = sync_workers(server.address, model, batch, STEPS, WORKERS, len(ds.train_x), flat=flat)
    # The reference: one process, batch 2b made of each round's two batches.
    ref = large_batch_reference(model, lambda p: torch.optim.SGD(p, lr=0.05), batch, STEPS, WORKERS)
    c = server.coordinator
    state = layout.state_dict(c.manifest, c.store.weights)
    assert set(state) == set(model.state_dict())  # parameters and buffers
    served = replica(model)
    served.load_state_dict(state, strict=True)
    bn, ref_bn = served[1], ref[1]
    assert int(bn.num_batches_tracked) == STEPS
    # The mean of two half-batch running means is the doubled batch's running mean, up to
    # the small drift of the weights (normalising by half-batch statistics).
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean, rtol=0.05, atol=0.05)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var, rtol=0.15, atol=0.05)
    assert bn.running_mean.abs().mean() > 0.5  # it moved away from the initial zeros
    acc, ref_acc = _accuracy(served, ds), _accuracy(ref, ds)
    assert ref_acc > 0.3 and acc > ref_acc - 0.05, (acc, ref_acc)
    # Every worker goes on from the shared statistics: its last step's pull left it with the
    # server's buffers, not its own half-batch ones.
    for final in finals:
        for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            assert torch.equal(final[name], state[name]), name


def test_a_server_checkpoint_loads_strictly_and_resumes(serve, tmp_path):
    """Parameters, buffers and frozen parameters: the server's checkpoint is the model's
    whole state dict, and a new server resumes from it."""
    model = bn_model()
    model[0].weight.requires_grad_(False)  # frozen: never sent, but in the checkpoint
    ds = data.synthetic(train=4 * BATCH, test=16)
    first = serve(
        replica(model),
        policy="async",
        workers=1,
        batch_size=BATCH,
        dataset="synthetic",
        checkpoint_dir=str(tmp_path),
    )
    local = replica(model)
    with ps.Worker(first.address, local, train_samples=len(ds.train_x)) as w:
        for _ in range(3):
            x, y = _batch(ds, w.batch)
            F.cross_entropy(local(x), y).backward()
            w.step(samples=len(x))
    first.stop()
    saved = checkpoint.load(tmp_path / checkpoint.SERVER_FILE)
    fresh = bn_model()
    fresh.load_state_dict(saved["model_state_dict"], strict=True)
    assert saved["frozen"] == ["0.weight"] and saved["version"] == 3
    assert int(fresh[1].num_batches_tracked) == 3 and fresh[1].running_mean.abs().sum() > 0
    for name, value in local.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    again = serve(
        replica(model),
        policy="async",
        workers=1,
        batch_size=BATCH,
        dataset="synthetic",
        checkpoint_dir=str(tmp_path),
    )
    assert again.coordinator.store.version == 3
    assert again.coordinator.store.weights.tolist() == first.coordinator.store.weights.tolist()
