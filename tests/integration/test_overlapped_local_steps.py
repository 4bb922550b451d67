"""Overlapped local steps (issue 58, must 1): ``LocalSteps(worker, overlap=True)`` and
``--inner-optimizer adamw --overlap on`` push a round's pseudo-gradient from the background
while the replica trains the next round, and merge the new global weights in as they land,
keeping the steps taken meanwhile (``training/inflight.py``)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import paramserver as ps
from paramserver.config import WorkerConfig
from paramserver.training import data
from paramserver.training.trainer import run
from tests import gpt
from tests.conftest import WorkerThread

H, ROUNDS, BATCH = 3, 4, 8


def _gpt() -> gpt.GPT:
    torch.manual_seed(0)
    return gpt.GPT(dim=16, layers=1, heads=2)


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = gpt.text(H * ROUNDS * BATCH, seed=1 + rank)
    return list(zip(x.split(BATCH), y.split(BATCH), strict=True))


def _train_alone(model: torch.nn.Module, batches: list) -> list[torch.Tensor]:
    """The same inner steps with no server at all."""
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    for x, y in batches:
        gpt.loss(model, x, y).backward()
        inner.step()
        inner.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _overlapped(worker: ps.Worker, batches: list) -> ps.LocalSteps:
    """The user's loop with the exchange behind the inner steps; merges as weights land."""
    local = ps.LocalSteps(worker, overlap=True)
    inner = torch.optim.SGD(local.model.parameters(), lr=0.5)
    for i, (x, y) in enumerate(batches):
        gpt.loss(local.model, x, y).backward()
        inner.step()
        inner.zero_grad()
        local.merge()
        if (i + 1) % H == 0:
            local.sync(samples=H * BATCH)
    local.land()
    return local


@pytest.mark.parametrize("policy", ["sync", "async"])
def test_every_inner_step_is_pushed_once_and_none_is_lost(serve, policy):
    """One worker, the outer step plain SGD at lr 1 (the global weights := the anchor minus
    the pseudo-gradient): whatever lands when, the replica and the server end where the
    same inner steps end with no server, on a GPT whose head is tied to its embedding."""
    server = serve(_gpt(), policy=policy, workers=1, optimizer="sgd", lr=1.0)
    batches = _batches(0)
    with ps.Worker(server.address, _gpt(), overlap=False) as worker:
        local = _overlapped(worker, batches)
        assert local.model is not worker.model
        assert local.model.head.weight is local.model.tok.weight  # still tied in the copy
        assert local.flight is not None and local.flight.rounds_merged == ROUNDS
        mine = [p.detach().clone() for p in local.model.parameters()]
    alone = _train_alone(_gpt(), batches)
    served = server.model_state_dict()
    assert torch.equal(served["head.weight"], served["tok.weight"])
    for got, want, (name, _) in zip(mine, alone, _gpt().named_parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(served[name], want, rtol=1e-4, atol=1e-5, msg=name)
    status = server.status()
    assert status["version"] == status["pushes_applied"] == ROUNDS


def test_batchnorm_statistics_go_out_with_the_push_and_stay_through_the_merge(serve):
    """A model's buffers travel as the replica's values: with one worker and outer SGD at
    lr 1, the server's and the replica's BatchNorm statistics end where the same steps end
    with no server (before: the pulled buffers went back out, and came back as zeros)."""

    def bn() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)
        )

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(16, 4, generator=g) * 3 + 1, torch.randint(0, 2, (16,), generator=g))]
    batches *= H * ROUNDS
    server = serve(bn(), policy="sync", workers=1, optimizer="sgd", lr=1.0)
    with ps.Worker(server.address, bn(), overlap=False) as worker:
        local = ps.LocalSteps(worker, overlap=True)
        inner = torch.optim.SGD(local.model.parameters(), lr=0.1)
        for i, (x, y) in enumerate(batches):
            torch.nn.functional.cross_entropy(local.model(x), y).backward()
            inner.step()
            inner.zero_grad()
            local.merge()
            if (i + 1) % H == 0:
                local.sync(samples=H * 16)
        local.land()
        mine = {k: v.clone() for k, v in local.model.state_dict().items()}
    alone = bn()
    inner = torch.optim.SGD(alone.parameters(), lr=0.1)
    for x, y in batches:
        torch.nn.functional.cross_entropy(alone(x), y).backward()
        inner.step()
        inner.zero_grad()
    served = server.model_state_dict()
    for name, want in alone.state_dict().items():
        torch.testing.assert_close(mine[name], want, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(served[name], want, rtol=1e-4, atol=1e-5, msg=name)
    assert int(served["1.num_batches_tracked"]) == H * ROUNDS


def test_two_sync_workers_end_on_the_global_weights_with_each_round_applied_once(serve):
    """Two workers under sync with Nesterov's outer step: a round's two pseudo-gradients
    make one outer step, each round once, and once the last has landed both replicas hold
    the server's weights (no progress was left out of a push)."""
    server = serve(_gpt(), policy="sync", workers=2, optimizer="nesterov", lr=0.7, momentum=0.9)

    def worker(rank: int) -> list[torch.Tensor]:
        with ps.Worker(server.address, _gpt(), name=f"w{rank}", overlap=False) as w:
            local = _overlapped(w, _batches(rank))
            return [p.detach().clone() for p in local.model.parameters()]

    threads = [WorkerThread(lambda r=r: worker(r), f"w{r}") for r in range(2)]
    for t in threads:
        t.start()
    ends = [t.result() for t in threads]
    status = server.status()
    assert status["version"] == ROUNDS and status["pushes_applied"] == 2 * ROUNDS
    served = server.model_state_dict()
    for end in ends:
        for got, (name, _) in zip(end, _gpt().named_parameters(), strict=True):
            torch.testing.assert_close(got, served[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_exchange_failing_is_raised_to_the_loop_and_the_replica_reset():
    """A failure of the background exchange is raised by the next sync (not lost on its
    thread), and the replica goes back to the weights last pulled."""
    from types import SimpleNamespace

    model = torch.nn.Linear(3, 2)
    calls = []

    def step(samples: int, loss: float) -> None:
        calls.append(samples)
        raise ps.ParamServerError("the shard went away")

    fake = SimpleNamespace(overlap=False, tables=None, model=model, step=step)
    local = ps.LocalSteps(fake, overlap=True)
    pulled = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in local.model.parameters():
            p.add_(1.0)
    local.sync(samples=5)
    with pytest.raises(ps.ParamServerError, match="the shard went away"):
        local.sync(samples=6)
    assert calls == [5]  # the second round was not sent over a failed one
    for p, want in zip(local.model.parameters(), pulled, strict=True):
        assert torch.equal(p.detach(), want)


def test_anchoring_while_a_round_flies_is_refused_and_a_failed_loop_settles_it():
    from types import SimpleNamespace

    released = threading.Event()
    closed = []
    fake = SimpleNamespace(
        overlap=False,
        tables=None,
        model=torch.nn.Linear(2, 2),
        step=lambda samples, loss: released.wait(30),
        close_quietly=lambda: closed.append(released.is_set()),
    )
    with (
        pytest.raises(RuntimeError, match="the loop failed"),
        ps.LocalSteps(fake, overlap=True) as local,
    ):
        local.sync(samples=1)
        with pytest.raises(ps.ConfigError, match="in flight"):
            local.anchored()
        threading.Timer(0.2, released.set).start()
        raise RuntimeError("the loop failed")
    assert closed == [True]  # the worker was closed only once its round had ended


@pytest.mark.parametrize("policy", ["sync", "async"])
def test_the_built_in_worker_overlaps_and_applies_each_batch_once(serve, tmp_path, policy):
    """``--inner-optimizer adamw --overlap on`` with two workers: every batch applied once
    (their --batch-log lines together name each batch once), a push per H batches."""
    epochs, batch, k = 1, 64, 4
    server = serve(
        "mlp",
        policy=policy,
        workers=2,
        optimizer="nesterov",
        lr=0.7,
        dataset="synthetic",
        batch_size=batch,
        epochs=epochs,
    )
    logs = [tmp_path / f"w{r}.log" for r in range(2)]

    def work(r: int):
        cfg = WorkerConfig(
            server.address,
            device="cpu",
            push_every=k,
            inner_optimizer="adamw",
            overlap="on",
            batch_log=str(logs[r]),
            name=f"w{r}",
        )
        return run(cfg)

    threads = [WorkerThread(lambda r=r: work(r), f"w{r}") for r in range(2)]
    for t in threads:
        t.start()
    summaries = [t.result() for t in threads]
    total = epochs * data.batches_per_epoch(data.SYNTHETIC_TRAIN, batch)
    status = server.status()
    assert status["batches_done"] == status["batches_applied"] == total, status
    logged = [
        int(b)
        for path in logs
        for line in Path(path).read_text().splitlines()
        for b in line.split()
    ]
    assert sorted(logged) == list(range(total))
    assert sum(s.samples for s in summaries) == total * batch
    assert status["pushes_applied"] == sum(s.steps for s in summaries)
