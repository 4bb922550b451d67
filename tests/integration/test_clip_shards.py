"""``--clip-grad-norm`` over the whole step (issue 56, must 4): under sync the servers clip
each round's mean gradient by its L2 norm over every shard and every sparse table's rows,
as ``torch.nn.utils.clip_grad_norm_`` clips a model's gradients in one process. Each
shard's round closes with its part of the squared norm; the workers relay the parts'
sum between the shards (``worker/norm_relay.py``). Two sync workers over one, two and
three shards end where one process running torch's Adam with the clip ends; a model with
sparse tables, on one server and on two, where torch's SGD with the clip over its dense
gradients ends. Under ssp:K and async each push is clipped by the norm its worker says.
On d1479b8 a sharded run or a model with tables refused the option."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from tests import sparse_models
from tests.conftest import WorkerThread

CLIP = 0.3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 6, generator=g) * 3, torch.randint(0, 3, (16,), generator=g))
        for _ in range(steps)
    ]


def _servers(serve, start: nn.Module, shards: int, **settings) -> list[ps.ServerApp]:
    """``shards`` servers (sync of two workers unless ``settings`` say) clipping at CLIP."""
    settings = {"policy": "sync", "workers": 2, **settings}
    return [
        serve(copy.deepcopy(start), clip_grad_norm=CLIP, shard=i, shards=shards, **settings)
        for i in range(shards)
    ]


def _train(addresses: list[str], start: nn.Module, batches, workers: int = 2, **how) -> None:
    """Each worker its half of every batch (all of it for one worker)."""

    def run(rank: int) -> None:
        replica = copy.deepcopy(start)
        n = len(batches[0][0]) // workers
        with ps.Worker(addresses, replica, **how) as worker:
            for x, y in batches:
                part = slice(rank * n, rank * n + n)
                F.cross_entropy(replica(x[part]), y[part]).backward()
                worker.step(samples=n)

    threads = [WorkerThread(lambda r=r: run(r), name=f"w{r}") for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.result(timeout=120)


def _local(start: nn.Module, batches, opt, workers: int = 2) -> tuple[nn.Module, list[float]]:
    """One process: each step the workers' parts averaged, clipped as torch clips; the norms
    before the clip."""
    local = copy.deepcopy(start)
    optimizer = opt(local.parameters())
    norms = []
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        n = len(x) // workers
        parts = [slice(r * n, r * n + n) for r in range(workers)]
        (sum(F.cross_entropy(local(x[p]), y[p]) for p in parts) / workers).backward()
        for p in local.parameters():
            if p.grad is not None and p.grad.is_sparse:  # clip_grad_norm_ takes dense ones
                p.grad = p.grad.to_dense()
        norms.append(float(torch.nn.utils.clip_grad_norm_(local.parameters(), CLIP)))
        optimizer.step()
    return local, norms


@pytest.mark.parametrize(
    "shards, how", [(1, {}), (2, {}), (3, {}), (2, {"overlap": False}), (2, {"shm": False})]
)
def test_a_sync_round_is_clipped_by_its_norm_over_every_shard(serve, shards, how):
    start = model()
    servers = _servers(serve, start, shards, optimizer="adam", lr=0.01)
    batches = data(10)
    _train([s.address for s in servers], start, batches, **how)
    local, norms = _local(start, batches, lambda p: torch.optim.Adam(p, lr=0.01))
    assert min(norms) > CLIP  # every step was clipped
    got = ps.model_state_dict([s.address for s in servers], model())
    for name, p in local.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    if shards > 1:  # every round came through the workers' relay
        assert all(s.status()["version"] == len(batches) for s in servers)


ROWS = 64


def _tables_model() -> nn.Module:
    torch.manual_seed(0)
    return sparse_models.Clicky(ROWS, 4, 3)


def _table_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    ids = (torch.rand(steps, 16, 3, generator=g) * ROWS).long()
    return [(ids[i], ids[i].sum(1) % 2) for i in range(steps)]


@pytest.mark.parametrize("shards", [1, 2])
def test_a_tables_rows_count_in_the_norm_and_are_clipped_with_it(serve, shards):
    start = _tables_model()
    servers = _servers(serve, start, shards, optimizer="sgd", lr=0.5)
    batches = _table_batches(6)
    _train([s.address for s in servers], start, batches)
    local, norms = _local(start, batches, lambda p: torch.optim.SGD(p, lr=0.5))
    assert min(norms) > CLIP
    got = ps.model_state_dict([s.address for s in servers], _tables_model())
    for name, p in local.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("policy", ["async", "ssp:1"])
@pytest.mark.parametrize("tables, shards", [(False, 2), (True, 1), (True, 2)])
def test_under_ssp_and_async_each_push_is_clipped_by_the_norm_its_worker_says(
    serve, policy, tables, shards
):
    """A step is one push there: its worker says its squared norm over every shard and
    table (PushHeader.norm_sq), and every shard scales it by the same factor. One worker:
    each of its pushes is torch's step on its batch, clipped."""
    start = _tables_model() if tables else model()
    batches = _table_batches(6) if tables else data(6)
    servers = _servers(serve, start, shards, optimizer="sgd", lr=0.5, policy=policy, workers=1)
    _train([s.address for s in servers], start, batches, workers=1)
    local, norms = _local(start, batches, lambda p: torch.optim.SGD(p, lr=0.5), workers=1)
    assert min(norms) > CLIP
    got = ps.model_state_dict([s.address for s in servers], _tables_model() if tables else model())
    for name, p in local.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_push_that_does_not_say_its_norm_is_refused_where_the_servers_need_it(serve):
    from paramserver.server.bookkeeping.norm_round import push_factor

    with pytest.raises(ps.InvalidRequest, match="the push must say it"):
        push_factor(CLIP, None)
    with pytest.raises(ps.InvalidRequest, match="finite and >= 0"):
        push_factor(CLIP, float("nan"))
    server = _servers(serve, model(), 2, policy="async", workers=1)[0]
    assert server.status()["version"] == 0  # it starts: the option is taken there now
