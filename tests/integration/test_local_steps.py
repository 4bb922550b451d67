"""Local steps with the server as the outer optimizer (DiLoCo, issue 45, first step):
``ps.LocalSteps`` in a user's loop pushes the pseudo-gradient (the weights pulled minus the
weights after H inner steps); under sync the server averages a round's into one outer step
(``--optimizer nesterov``: SGD with Nesterov momentum); the built-in worker does the same
with ``--inner-optimizer`` over ``--push-every H`` batches, each batch applied once."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver.config import WorkerConfig
from paramserver.errors import ConfigError
from paramserver.training import data
from paramserver.training.trainer import run
from tests.conftest import WorkerThread

H, OUTER_LR, MOMENTUM = 3, 0.7, 0.9


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [
        (torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(H)
    ]


def _local(model: torch.nn.Module, rank: int) -> list[torch.Tensor]:
    """What worker ``rank``'s H inner AdamW steps make of ``model``'s weights."""
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    for x, y in _batches(rank):
        F.cross_entropy(model(x), y).backward()
        inner.step()
        inner.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_a_sync_round_applies_the_mean_pseudo_gradient_with_nesterov(serve):
    server = serve(
        _model(), policy="sync", workers=2, optimizer="nesterov", lr=OUTER_LR, momentum=MOMENTUM
    )
    start = [p.detach().clone() for p in _model().parameters()]

    def worker(rank: int) -> list[torch.Tensor]:
        model = _model()
        with ps.Worker(server.address, model, name=f"w{rank}", overlap=False) as w:
            local = ps.LocalSteps(w)
            _local(model, rank)
            local.sync(samples=H * 16)  # push, pull the round's outer step
            assert all(torch.equal(a, p) for a, p in zip(local.anchor, local.params, strict=True))
            return [p.detach().clone() for p in model.parameters()]

    threads = [WorkerThread(lambda r=r: worker(r), f"w{r}") for r in range(2)]
    for t in threads:
        t.start()
    pulled = [t.result() for t in threads]
    # by hand: the mean of w0 - w_i, one step of torch's SGD with Nesterov momentum
    ends = [_local(_model(), r) for r in range(2)]
    outer = [torch.nn.Parameter(p.clone()) for p in start]
    opt = torch.optim.SGD(outer, lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
    for p, w0, a, b in zip(outer, start, *ends, strict=True):
        p.grad = ((w0 - a) + (w0 - b)) / 2
    opt.step()
    for got in pulled:
        for g, want in zip(got, outer, strict=True):
            torch.testing.assert_close(g, want.detach(), rtol=1e-5, atol=1e-6)
    assert server.status()["version"] == 1  # one outer step for the round


def test_the_built_in_worker_takes_local_steps_and_applies_each_batch_once(serve):
    epochs, batch, k = 1, 64, 4
    server = serve(
        "mlp",
        policy="async",
        workers=1,
        optimizer="nesterov",
        lr=OUTER_LR,
        dataset="synthetic",
        batch_size=batch,
        epochs=epochs,
    )
    cfg = WorkerConfig(server.address, device="cpu", push_every=k, inner_optimizer="adamw")
    t = WorkerThread(lambda: run(cfg), "w")
    t.start()
    summary = t.result()
    total = epochs * data.batches_per_epoch(data.SYNTHETIC_TRAIN, batch)
    status = server.status()
    assert status["batches_done"] == status["batches_applied"] == total, status
    assert summary.samples == total * batch
    assert status["pushes_applied"] == summary.steps == -(-total // k)  # a push per H batches


def test_local_steps_are_refused_where_they_cannot_work(serve):
    with pytest.raises(ConfigError, match="--inner-optimizer must be one of none, sgd, adamw"):
        WorkerConfig(server="127.0.0.1:1", inner_optimizer="lamb")
    # --overlap on: the exchange behind the inner steps (test_overlapped_local_steps.py)
    assert WorkerConfig(server="127.0.0.1:1", inner_optimizer="adamw", overlap="on").overlap == "on"
    with pytest.raises(ConfigError, match="--amp fp16 is not supported"):
        WorkerConfig(server="127.0.0.1:1", inner_optimizer="sgd", amp="fp16")
    server = serve(_model(), workers=1, policy="async")
    with (
        ps.Worker(server.address, copy.deepcopy(_model()), overlap=True) as w,
        pytest.raises(ConfigError, match="Worker\\(overlap=False\\)"),
    ):
        ps.LocalSteps(w)


def test_the_pseudo_gradient_goes_into_gradients_that_exist_in_place():
    """A flat replica's gradients are views of one buffer (CUDA workers): written in place."""
    from types import SimpleNamespace

    model = _model()
    local = ps.LocalSteps(SimpleNamespace(overlap=False, tables=None, model=model))
    views = []
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
        views.append(p.grad)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    local.into_grads()
    for p, view in zip(model.parameters(), views, strict=True):
        assert p.grad is view and torch.allclose(view, torch.full_like(view, -0.5))


def test_a_worker_joining_mid_round_starts_from_the_current_global_weights(serve):
    """Worker a trains alone for two rounds, then b joins while a is in the middle of its
    third round's inner steps: b's replica (and its anchor) is the global model as it is,
    not b's own initial weights, and the round closes with both pseudo-gradients."""
    server = serve(
        _model(),
        policy="sync",
        workers=2,
        min_workers=1,
        optimizer="nesterov",
        lr=OUTER_LR,
        momentum=MOMENTUM,
    )
    model_a, model_b = _model(), _model()
    with ps.Worker(server.address, model_a, name="a", overlap=False) as a:
        local_a = ps.LocalSteps(a)
        for _ in range(2):
            _local(model_a, 0)
            local_a.sync(samples=H * 16)
        _local(model_a, 0)  # mid-round: a pulled version 2 and stepped on its own
        current = [p.detach().clone() for p in server.model_state_dict().values()]
        assert server.status()["version"] == 2
        with ps.Worker(server.address, model_b, name="b", overlap=False) as b:
            local_b = ps.LocalSteps(b)
            joined = [p.detach().clone() for p in local_b.anchor]
            _local(model_b, 1)
            b_sync = WorkerThread(lambda: local_b.sync(samples=H * 16), "b")
            b_sync.start()
            local_a.sync(samples=H * 16)
            b_sync.result()
            assert all(  # both pulled the round's one outer step
                torch.equal(x, y)
                for x, y in zip(model_a.parameters(), model_b.parameters(), strict=True)
            )
    for got, want in zip(joined, current, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(joined[0], next(_model().parameters()).detach())
    status = server.status()
    assert status["version"] == 3 and status["pushes_applied"] == 4  # a's 3, b's 1
