"""A worker whose model is flat (``worker/flat.py``: a CUDA worker's default), on CPU: with
its pushes in the background (overlap, a CUDA worker's default) its gradient buckets go to a
free push slot during backward, over each payload path, and one sync worker still takes
exactly the steps of local SGD."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver.worker.flat import FlatReplica
from tests.conftest import assert_same_state, local_sgd, replica, tiny_model

STEPS, BATCH = 6, 8


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


@pytest.mark.parametrize("path", ["shm", "data port", "grpc"])
def test_a_flat_overlapped_sync_worker_takes_local_sgd_steps(serve, monkeypatch, path):
    model = tiny_model()
    server = serve(replica(model), optimizer="sgd", lr=0.1, policy="sync", workers=1)
    early: list[int] = []
    copy_early = FlatReplica._copy_early

    def counted(self, bucket):  # type: ignore[no-untyped-def]
        copy_early(self, bucket)
        early.append(bucket.copied_at)

    monkeypatch.setattr(FlatReplica, "_copy_early", counted)
    local = replica(model)
    options = {"shm": path == "shm", "wire": "grpc" if path == "grpc" else "auto"}
    with ps.Worker(server.address, local, flat=True, overlap=True, **options) as w:
        assert isinstance(w._replica, FlatReplica)
        assert w.shm_active is (path == "shm")
        assert w.data_port_active is (path == "data port")
        for step in range(STEPS):
            x, y = _batch(step)
            F.cross_entropy(local(x), y).backward()
            w.step(samples=BATCH)
    assert_same_state(local, local_sgd(model, _batch, STEPS, 0.1), rtol=1e-5, atol=1e-6)
    # the buckets went during backward: always in the first step (its slot is free); later,
    # when the last push's answer is still on its way as backward ends, staging copies them
    assert early and early[0] > 0
