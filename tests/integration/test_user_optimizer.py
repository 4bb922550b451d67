"""A user's optimizer factory on the servers (issue 56, must 2): ``ps.serve(optimizer=
factory)`` or ``--optimizer module:function`` builds the user's optimizer class with its
parameter groups over each shard's slices, so per-group rates, decay, betas and eps hold:
two sync workers equal one process running the factory's optimizer on the whole batch, on
one server and over two shards; a checkpoint resumes it exactly; a schedule scales each
group's own rate; refusals are one line. On d1479b8 there was no such option."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from tests import user_optimizers
from tests.conftest import WorkerThread


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))
        for _ in range(steps)
    ]


def _train(addresses: list[str], start: nn.Module, batches, workers: int = 2) -> None:
    def run(rank: int) -> None:
        replica = copy.deepcopy(start)
        with ps.Worker(addresses, replica) as worker:
            for x, y in batches:
                half = slice(rank * 8, rank * 8 + 8) if workers == 2 else slice(None)
                F.cross_entropy(replica(x[half]), y[half]).backward()
                worker.step(samples=8)

    threads = [WorkerThread(lambda r=r: run(r), name=f"w{r}") for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.result(timeout=60)


def _local(start: nn.Module, factory, batches, schedule=None) -> nn.Module:
    local = copy.deepcopy(start)
    opt = factory(local.named_parameters())
    sched = schedule(opt) if schedule else None
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        halves = [F.cross_entropy(local(x[p]), y[p]) for p in (slice(0, 8), slice(8, 16))]
        (sum(halves) / 2).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return local


def _whole(servers: list[ps.ServerApp]) -> dict[str, torch.Tensor]:
    return ps.model_state_dict([s.address for s in servers], model())


@pytest.mark.parametrize("shards", [1, 2])
def test_the_users_adamw_groups_train_as_one_process(serve, shards):
    start = model()
    servers = [
        serve(
            copy.deepcopy(start),
            optimizer=user_optimizers.adamw_groups,
            policy="sync",
            workers=2,
            shard=i,
            shards=shards,
        )
        for i in range(shards)
    ]
    batches = data(8)
    _train([s.address for s in servers], start, batches)
    local = _local(start, user_optimizers.adamw_groups, batches)
    got = _whole(servers)
    for name, p in local.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_named_factory_resumes_from_its_checkpoint_exactly(serve, tmp_path):
    start = model()
    settings = dict(optimizer="tests.user_optimizers:adamw_groups", policy="sync", workers=1)
    batches = data(6)
    whole = serve(copy.deepcopy(start), **settings)
    _train([whole.address], start, batches, workers=1)
    expected = _whole([whole])
    first = serve(copy.deepcopy(start), checkpoint_dir=str(tmp_path), **settings)
    _train([first.address], start, batches[:3], workers=1)
    first.stop()  # writes its last checkpoint
    resumed = serve(copy.deepcopy(start), checkpoint_dir=str(tmp_path), **settings)
    assert resumed.status()["version"] == 3
    mid = copy.deepcopy(start)
    mid.load_state_dict(_whole([resumed]))
    _train([resumed.address], mid, batches[3:], workers=1)
    got = _whole([resumed])
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def _train_skipping_head(addresses: list[str], start: nn.Module, batches) -> None:
    """One worker; the head has no gradient at every other batch (not stepped)."""
    replica = copy.deepcopy(start)
    with ps.Worker(addresses, replica) as worker:
        for i, (x, y) in enumerate(batches):
            F.cross_entropy(replica(x), y).backward()
            if i % 2 == 1:
                replica[3].weight.grad = replica[3].bias.grad = None
            worker.step(samples=len(x))


def test_resumed_on_another_shard_count_each_parameter_keeps_its_own_step(serve, tmp_path):
    """Two shards checkpoint after 4 steps (the head stepped twice, the rest four times);
    one server resumes there and ends as the uninterrupted run. Before, the reshard gave
    every parameter shard 0's largest step: the head was bias-corrected as stepped four
    times, and the run ended elsewhere."""
    start = model()
    settings = dict(optimizer=user_optimizers.adamw_groups, policy="sync", workers=1)
    batches = data(8)
    whole = serve(copy.deepcopy(start), **settings)
    _train_skipping_head([whole.address], start, batches)
    expected = _whole([whole])
    folder = str(tmp_path)
    two = [
        serve(copy.deepcopy(start), shard=i, shards=2, checkpoint_dir=folder,
              checkpoint_every="4", **settings)
        for i in range(2)
    ]  # fmt: skip
    _train_skipping_head([s.address for s in two], start, batches[:4])
    for s in two:
        s.stop()
    one = serve(copy.deepcopy(start), checkpoint_dir=folder, **settings)
    assert one.status()["version"] == 4
    mid = copy.deepcopy(start)
    mid.load_state_dict(_whole([one]))
    _train_skipping_head([one.address], mid, batches[4:])
    got = _whole([one])
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)


def test_a_schedule_scales_each_groups_own_rate(serve):
    start = model()
    server = serve(
        copy.deepcopy(start),
        optimizer=user_optimizers.adamw_groups,
        policy="sync",
        workers=2,
        lr=1.0,
        lr_warmup=3,
    )
    batches = data(5)
    _train([server.address], start, batches)
    warm = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 3))  # noqa: E731
    local = _local(start, user_optimizers.adamw_groups, batches, warm)
    got = _whole([server])
    for name, p in local.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_what_a_factory_sets_is_refused_beside_it_in_one_line(serve):
    with pytest.raises(ps.ConfigError, match="set it in the factory instead"):
        serve(model(), optimizer="tests.user_optimizers:adamw_groups", weight_decay=0.1)
    with pytest.raises(ps.ConfigError, match="returned list, not a torch.optim.Optimizer"):
        serve(model(), optimizer="tests.user_optimizers:not_an_optimizer")
    with pytest.raises(ps.ConfigError, match="has no function"):
        serve(model(), optimizer="tests.user_optimizers:nope")


def test_a_table_takes_the_row_optimizer_of_the_users_class(serve):
    from tests import sparse_models

    torch.manual_seed(0)
    clicky = sparse_models.Clicky(50, 4, 3)
    server = serve(clicky, optimizer=user_optimizers.sgd_nesterov, workers=1)
    assert server.coordinator.tables.table("emb").optimizer.config.name == "sgd"
    with pytest.raises(ps.ConfigError, match="--table-optimizer"):
        serve(sparse_models.Clicky(50, 4, 3), optimizer=user_optimizers.rmsprop, workers=1)
