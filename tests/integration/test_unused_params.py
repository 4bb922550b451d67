"""A parameter whose gradient is None at a step is not stepped, as in torch (issue 56,
must 7): no decay, no momentum moves it. A layer the model never calls keeps its initial
values exactly; a branch used every other step trains as torch's SGD with momentum and
decay trains it (its buffer waits while it is unused); under sync a parameter is stepped
when any worker's batch reached it, as one large batch's backward would; over two shards
each shard leaves its part alone. On d1479b8 every such parameter was pushed as zeros and
stepped: decay and momentum moved it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from tests.conftest import WorkerThread


class Branchy(nn.Module):
    """A trunk, a branch used when asked, and a layer nothing calls."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 4)
        self.branch = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if branch:
            h = h + self.branch(h)
        return self.head(h)  # type: ignore[no-any-return]


def _data(steps: int, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
        for _ in range(steps)
    ]


SETTINGS = dict(optimizer="momentum", lr=0.1, momentum=0.9, weight_decay=0.05)


@pytest.mark.parametrize(("shards", "flat"), [(1, False), (2, False), (1, True), (2, True)])
def test_unused_parameters_are_not_stepped_and_a_branch_trains_as_in_torch(serve, shards, flat):
    """``flat``: the worker's FlatReplica (a CUDA model's default), whose gradients are
    views that are never None: a parameter has none when backward reached nothing of it."""
    torch.manual_seed(0)
    model = Branchy()
    local = copy.deepcopy(model)
    start = copy.deepcopy(model)
    servers = [
        serve(model, policy="async", workers=1, shard=i, shards=shards, **SETTINGS)
        for i in range(shards)
    ]
    opt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05)
    with ps.Worker([s.address for s in servers], model, flat=flat) as worker:
        for step, (x, y) in enumerate(_data(8)):
            branch = step % 2 == 0
            F.cross_entropy(model(x, branch), y).backward()
            worker.step(samples=len(x))
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(local(x, branch), y).backward()
            opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, dict(local.named_parameters())[name], msg=name)
    assert torch.equal(model.unused.weight, start.unused.weight)
    assert torch.equal(model.unused.bias, start.unused.bias)


def test_adam_leaves_a_layer_nothing_calls_exactly_as_it_was(serve):
    torch.manual_seed(1)
    model = Branchy()
    start = copy.deepcopy(model)
    server = serve(model, optimizer="adamw", lr=0.01, weight_decay=0.1, policy="async", workers=1)
    with ps.Worker(server.address, model) as worker:
        for x, y in _data(5):
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))
    assert torch.equal(model.unused.weight, start.unused.weight)
    assert not torch.equal(model.trunk.weight, start.trunk.weight)
    # nor is its state moved: its moments are still zero
    state = server.coordinator.store.optimizer.state[server.coordinator.store.param]
    names = [n for n, _ in start.named_parameters()]
    at = 0
    for n, p in start.named_parameters():
        if n.startswith("unused"):
            assert not state["exp_avg"][at : at + p.numel()].any(), n
            assert not state["exp_avg_sq"][at : at + p.numel()].any(), n
        at += p.numel()
    assert names  # the walk above covered the model


def test_under_sync_a_parameter_any_worker_reached_is_stepped(serve):
    """Worker 0's batches go through the branch, worker 1's never: the branch is stepped
    with the round's mean (worker 0's gradient over two), as one large batch whose half
    used it; the layer neither used is left alone."""
    torch.manual_seed(2)
    model = Branchy()
    local = copy.deepcopy(model)
    start = copy.deepcopy(model)
    server = serve(model, policy="sync", workers=2, **SETTINGS)
    data = _data(5, 16)

    def run(rank: int) -> None:
        replica = copy.deepcopy(start)
        with ps.Worker(server.address, replica) as worker:
            for x, y in data:
                half = slice(rank * 8, rank * 8 + 8)
                F.cross_entropy(replica(x[half], rank == 0), y[half]).backward()
                worker.step(samples=8)

    threads = [WorkerThread(lambda r=r: run(r), name=f"w{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.result(timeout=60)
    opt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05)
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(local(x[:8], True), y[:8]) + F.cross_entropy(
            local(x[8:], False), y[8:]
        )
        (loss / 2).backward()
        opt.step()
    whole = server.model_state_dict()
    for name, p in local.named_parameters():
        torch.testing.assert_close(whole[name], p.detach(), msg=name)
    assert torch.equal(whole["unused.weight"], start.unused.weight.detach())


def test_with_a_residual_a_parameter_without_a_gradient_is_pushed_as_zeros(serve):
    """Found by review: under --compress bf16 (error feedback) the codec adds a parameter's
    residual to its zeros; had the server left the range alone, the residual would be
    lost. Such a push names no range, and the unused layer is stepped as before (decay)."""
    torch.manual_seed(3)
    model = Branchy()
    start = copy.deepcopy(model)
    server = serve(model, policy="async", workers=1, **SETTINGS)
    with ps.Worker(server.address, model, compress="bf16") as worker:
        for x, y in _data(3):
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))
    on_server = server.model_state_dict()["unused.weight"]
    assert not torch.equal(on_server, start.unused.weight.detach())  # decayed, as before
