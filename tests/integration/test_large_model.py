"""A model of more than 64 MiB pushes and pulls exactly (no message-size limit)."""

from __future__ import annotations

import torch
from torch import nn

import paramserver as ps
from tests.conftest import replica


def big_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4096, 4100), nn.Linear(4100, 2))


def test_push_and_pull_of_a_model_over_64_mib_are_exact(serve):
    model = big_model()
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    assert nbytes > 64 * 2**20
    server = serve(replica(model), optimizer="sgd", lr=1.0, policy="async", workers=1)
    local = replica(model)
    with ps.Worker(server.address, local) as w:
        # The join's pull returned the server's weights bit for bit.
        for a, b in zip(local.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)
        g = torch.Generator().manual_seed(2)
        grads = [torch.randn(p.shape, generator=g) for p in local.parameters()]
        for p, grad in zip(local.parameters(), grads, strict=True):
            p.grad = grad.clone()
        w.step(pull=False)
        w.flush()  # async: a pull need not wait for our own push, so wait for it here
        w.pull()
        assert w.version == 1
    expected = [p.detach() - grad for p, grad in zip(model.parameters(), grads, strict=True)]
    for got, want in zip(local.parameters(), expected, strict=True):
        assert torch.equal(got.detach(), want)
    status = server.status()
    assert status["bytes_in"] == nbytes
    assert status["bytes_out"] >= 2 * nbytes
