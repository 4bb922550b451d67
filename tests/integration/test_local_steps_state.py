"""Local steps' guarantees (issue 45, item 4): the outer optimizer's state (Nesterov's
momentum, and Delayed Nesterov's) is in checkpoints, consistent cuts, resharding and export; a server restarted
from its checkpoint goes on with it; a worker killed in the middle of its H inner steps
loses only its local progress (its batches are handed out again, each applied once)."""

from __future__ import annotations

import signal

import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver.config import WorkerConfig
from paramserver.server.disk.export import export
from paramserver.server.disk.reshard import reshard
from paramserver.training import data
from paramserver.training.trainer import run
from tests.conftest import paramserver_popen, wait_until

MODEL, SEED, H, ROUNDS = "tests.integration.test_local_steps_state:dense", 0, 3, 4


def dense() -> torch.nn.Module:
    """A small dense model with BatchNorm (a buffer beside the parameters)."""
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )


def _server(
    serve, directory, shard: int = 0, shards: int = 1, outer: dict | None = None
) -> ps.ServerApp:
    return serve(
        MODEL,
        seed=SEED,
        **(outer or NESTEROV),
        lr=0.7,
        momentum=0.9,
        policy="sync",
        workers=1,
        shard=shard,
        shards=shards,
        checkpoint_dir=str(directory),
        checkpoint_every="2",
    )


def _rounds(addresses: list[str], rounds: int, start: int = 0) -> None:
    """``rounds`` DiLoCo rounds of one worker: H inner SGD steps, then a sync."""
    model = ps.models.build(MODEL, seed=SEED)
    with ps.Worker(addresses, model, overlap=False) as worker:
        local = ps.LocalSteps(worker, torch.optim.SGD(model.parameters(), lr=0.05))
        for r in range(start, start + rounds):
            g = torch.Generator().manual_seed(r)
            for _ in range(H):
                x = torch.randn(16, 6, generator=g)
                F.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
                local.inner.step()
                local.inner.zero_grad()
            local.sync(samples=H * 16)


def _momentum(state: dict) -> torch.Tensor:
    """The outer optimizer's per-element state, joined (Nesterov's buffer; Delayed
    Nesterov's buffer and its pushes pending since the momentum last moved)."""
    held = state["state"][0]
    return torch.cat([held[k].reshape(-1) for k in ("momentum_buffer", "pending") if k in held])


NESTEROV = {"optimizer": "nesterov"}
# Delayed Nesterov every 3 rounds: after 4, its momentum has moved once and round 4's
# pseudo-gradient is pending, so both parts have something to keep
DELAYED = {"optimizer": "delayed-nesterov", "nesterov_period": 3}


@pytest.mark.parametrize("outer", [NESTEROV, DELAYED], ids=["nesterov", "delayed-nesterov"])
def test_the_outer_momentum_is_in_checkpoints_cuts_resharding_and_export(serve, tmp_path, outer):
    one = _server(serve, tmp_path / "one", outer=outer)
    _rounds([one.address], ROUNDS)
    state = one.coordinator.store.optimizer_state()
    want = _momentum(state)
    assert want.abs().sum() > 0  # Nesterov's buffer is there to keep
    if outer is DELAYED:
        held = state["state"][0]
        assert held["pending"].abs().sum() > 0 and float(held["step"]) == ROUNDS
    one.stop()
    two = [_server(serve, tmp_path / "two", i, 2, outer) for i in range(2)]
    _rounds([s.address for s in two], ROUNDS)
    for s in two:
        s.stop()
    # export: the whole buffer, the shards' parts joined (sync: the same math as one server)
    for name in ("one", "two"):
        path, version, _ = export(tmp_path / name, MODEL, SEED, tmp_path / f"{name}.pt")
        saved = torch.load(path, weights_only=True)
        assert version == ROUNDS
        torch.testing.assert_close(_momentum(saved["optimizer_state"]), want, rtol=1e-5, atol=1e-7)
    # resharding 2 -> 1, and a server resumed from it: the buffer goes on as one server's
    reshard(tmp_path / "two", MODEL, SEED, 1, out=tmp_path / "joined")
    resumed = _server(serve, tmp_path / "joined", outer=outer)
    torch.testing.assert_close(
        _momentum(resumed.coordinator.store.optimizer_state()), want, rtol=1e-5, atol=1e-7
    )
    # a server restarted from its own checkpoint takes the same next steps as one that
    # never stopped (two: Delayed Nesterov's momentum moves at the second)
    again = _server(serve, tmp_path / "one", outer=outer)
    _rounds([again.address], 2, start=ROUNDS)
    _rounds([resumed.address], 2, start=ROUNDS)
    a, b = again.model_state_dict(), resumed.model_state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_cut_of_a_sharded_run_holds_each_shards_part_of_the_momentum(serve, tmp_path):
    shards = [_server(serve, tmp_path / "cuts", i, 2) for i in range(2)]
    _rounds([s.address for s in shards], ROUNDS)  # cuts after rounds 2 and 4
    parts = [_momentum(s.coordinator.store.optimizer_state()) for s in shards]
    for s in shards:
        s.stop()
    path, version, which = export(tmp_path / "cuts", MODEL, SEED, tmp_path / "cut.pt", round_=4)
    assert "cut" in which and version == ROUNDS
    saved = torch.load(path, weights_only=True)
    torch.testing.assert_close(_momentum(saved["optimizer_state"]), torch.cat(parts))


def test_a_worker_killed_mid_h_loses_only_its_local_steps(serve, tmp_path, children):
    batch, epochs = 64, 1
    server = serve(
        "mlp",
        policy="async",
        workers=2,
        min_workers=1,
        optimizer="nesterov",
        lr=0.7,
        momentum=0.9,
        dataset="synthetic",
        batch_size=batch,
        epochs=epochs,
        lease_seconds=1.0,
    )
    total = epochs * data.batches_per_epoch(data.SYNTHETIC_TRAIN, batch)
    args = ["--server", server.address, "--device", "cpu", "--push-every", "4"]
    args += ["--inner-optimizer", "sgd", "--inner-lr", "0.05", "--step-delay", "0.1"]
    doomed = _popen(tmp_path, "worker", *args, "--shm", "off")
    children.append(doomed)
    # its first pseudo-gradient applied: it is in the middle of its next 4 batches
    wait_until(lambda: server.status()["pushes_applied"] >= 1, "the first push applied")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(timeout=30)
    cfg = WorkerConfig(server=server.address, device="cpu", push_every=4, inner_optimizer="sgd")
    summary = run(cfg)
    status = server.status()
    assert status["workers_expired"] == 1  # its lease ran out: its 4 batches went back
    assert status["batches_done"] == status["batches_applied"] == total, status
    assert status["pushes_repeated"] == 0 and status["samples"] == total * batch
    assert summary.samples < total * batch  # the killed worker's pushes count, once each


def _popen(tmp_path, *args: str):
    import subprocess

    log = open(tmp_path / "doomed.log", "w")  # noqa: SIM115 - closed with the process
    return paramserver_popen(*args, stdout=log, stderr=subprocess.STDOUT)
