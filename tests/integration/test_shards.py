"""Sharded servers (--shard I/S): a worker drives every shard at once, and the result is the
unsharded run's, element for element (to an ulp under Adam); what goes wrong says so."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver.codec import layout
from paramserver.server.disk import checkpoint
from paramserver.training import data
from tests.conftest import DEADLINE, WorkerThread, launch_json, replica, tiny_model
from tests.integration.test_cli import run_cli


def _within_an_ulp(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_max_ulp(a, b, maxulp=2)


def _train(worker, model, steps: int) -> None:
    ds = data.synthetic(train=steps * 32, test=32)
    for i in range(steps):
        x, y = ds.train_x[i * 32 : (i + 1) * 32], ds.train_y[i * 32 : (i + 1) * 32]
        F.cross_entropy(model(x), y).backward()
        worker.step(samples=len(x))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("shards", [2, 3])
def test_sharded_servers_train_exactly_like_one(serve, tmp_path, optimizer, shards):
    start = tiny_model()
    one = serve(replica(start), optimizer=optimizer, policy="sync", workers=1)
    with ps.Worker(one.address, replica(start)) as w:
        _train(w, w.model, 10)
    expected = one.coordinator.store.weights.copy()

    servers = [
        serve(
            replica(start),
            optimizer=optimizer,
            policy="sync",
            workers=1,
            shard=i,
            shards=shards,
            checkpoint_dir=str(tmp_path),
            checkpoint_every="5",
        )
        for i in range(shards)
    ]
    model = replica(start)
    with ps.Worker([s.address for s in servers], model) as w:
        assert w.shards == shards and w.shm_active
        _train(w, model, 10)
        assert w.clock == 10 and all(s.status()["version"] == 10 for s in servers)
        got = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    # SGD: bit for bit. Adam's fused kernel takes a vectorised path for most elements and a
    # scalar one for a tensor's tail, whose ends move with the shard boundaries: 1 ulp.
    same = np.testing.assert_array_equal if optimizer == "sgd" else _within_an_ulp
    same(got, expected)
    # each shard holds its range, in order
    numel = expected.size
    for i, s in enumerate(servers):
        lo, hi = layout.shard_range(numel, i, shards)
        same(s.coordinator.store.weights, expected[lo:hi])
        s.stop()
        assert (tmp_path / checkpoint.server_file(i, shards)).exists()
        # consistent cuts at rounds 0, 5 and 10, the same on every shard; round 0's goes
        # once a pull says every shard has written round 5
        assert {5, 10} <= set(checkpoint.list_cuts(tmp_path, i, shards)) <= {0, 5, 10}


def test_a_plain_worker_at_a_shard_is_told_to_list_every_shard(serve):
    server = serve("mlp", shard=1, shards=2)
    with pytest.raises(ps.ConfigError, match="shard 1 of 2.*every shard's address"):
        ps.Worker(server.address)
    assert server.status()["workers"] == []


def test_shards_given_out_of_order_are_refused(serve):
    servers = [serve("mlp", shard=i, shards=2, workers=2) for i in range(2)]
    with pytest.raises(ps.ConfigError, match="given as shard 0 of 2"):
        ps.Worker([servers[1].address, servers[0].address])


def test_bad_shard_options_are_one_line_errors():
    for value in ("2/2", "x", "1/0", "-1/2"):
        out = run_cli("server", "--shard", value, "--port", "0", timeout=60)
        assert out.returncode == 2, out.stderr[-500:]
        assert "--shard must be I/S" in out.stderr.strip().splitlines()[-1]


def test_launch_with_two_server_shards(tmp_path):
    summary, _ = launch_json(
        tmp_path,
        "--dataset",
        "synthetic",
        "--workers",
        "2",
        "--servers",
        "2",
        "--epochs",
        "2",
        "--policy",
        "delay-1",
        "--lr",
        "0.003",
    )
    assert summary["samples"] == 2 * (4096 // 64) * 64
    assert summary["test_accuracy"] > 0.5
    run_dir = tmp_path / os.path.basename(summary["run_dir"])
    assert (run_dir / "server-0.log").exists() and (run_dir / "server-1.log").exists()
    # the run's checkpoint holds the whole model, gathered from both shards
    state = checkpoint.load(run_dir / "checkpoint.pt")
    assert set(state["model_state_dict"]) == {
        n for n, _ in ps.models.parameters(ps.models.build("mlp"))
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shards_carry_buffers_and_float64_like_one_server(serve, dtype):
    """A BatchNorm model with a large float buffer, split over 3 shards so that the last
    holds buffers only: the same parameters and buffers as one server, bit for bit."""
    torch.manual_seed(0)
    start = torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(784, 4),
        torch.nn.BatchNorm1d(4),
        torch.nn.Linear(4, 10),
    ).to(dtype)
    start.register_buffer("seen", torch.zeros(8000, dtype=dtype))

    def train(address) -> dict[str, torch.Tensor]:
        model = replica(start)
        ds = data.synthetic(train=6 * 32, test=32)
        with ps.Worker(address, model) as w:
            for i in range(6):
                x, y = (
                    ds.train_x[i * 32 : (i + 1) * 32].to(dtype),
                    ds.train_y[i * 32 : (i + 1) * 32],
                )
                F.cross_entropy(model(x), y).backward()
                model.seen += x.reshape(-1)[:8000]  # a buffer the user keeps up to date
                w.step(samples=len(x))
        return model.state_dict()

    one = serve(replica(start), optimizer="sgd", lr=0.1, policy="sync", workers=1)
    expected = train(one.address)
    servers = [
        serve(replica(start), optimizer="sgd", lr=0.1, policy="sync", workers=1, shard=i, shards=3)
        for i in range(3)
    ]
    roles = [{s.role for s in srv.coordinator.manifest.tensors} for srv in servers]
    assert roles[-1] == {"buffer", "count"}  # the last shard holds no parameter at all
    got = train([s.address for s in servers])
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert expected["2.num_batches_tracked"].item() == 6 and expected["seen"].abs().sum() > 0
    flat = np.concatenate([s.coordinator.store.weights for s in servers])
    assert flat.dtype == np.dtype(str(dtype)[6:])
    np.testing.assert_array_equal(flat, one.coordinator.store.weights)


def test_a_worker_joining_while_the_shards_are_a_round_apart_starts_at_one_clock(serve):
    """Shard 1 finished round 0 (every push reaches it before shard 0); shard 0 has not. A
    worker joining then starts at round 0 on shard 0 and round 1 on shard 1: it pushes an
    empty push to shard 0, so that its gradients are the same iteration on both (else two
    shards' cuts at one round hold different batches, and a rewind loses one)."""
    start = tiny_model()
    servers = [
        serve(replica(start), policy="sync", workers=2, min_workers=1, shard=i, shards=2)
        for i in range(2)
    ]
    c0, c1 = (s.coordinator for s in servers)
    first = ps.Worker([s.address for s in servers], replica(start))
    try:
        a0, a1 = first.sessions
        zero = np.zeros(c1.store.n_params, np.float32)
        c1.push(a1.worker_id, 0, zero, 32, 0.0, a1.incarnation)  # round 0 ends on shard 1
        assert (c0.rounds, c1.rounds) == (0, 1)
        joined: list[ps.Worker] = []
        second = WorkerThread(
            lambda: joined.append(ps.Worker([s.address for s in servers], replica(start)))
        )
        second.start()

        # its empty push of iteration 0 on shard 0: its clock is 1 there, as on shard 1
        def aligned(c) -> bool:
            return any(w != a0.worker_id and m.clock == 1 for w, m in c.membership.members.items())

        deadline = time.monotonic() + DEADLINE
        while second.is_alive() and time.monotonic() < deadline:  # its end notifies nobody
            if c0.wait_for(aligned, 0.1):
                break
        assert aligned(c0), [s.clock for s in joined[0].sessions]
        zero0 = np.zeros(c0.store.n_params, np.float32)
        c0.push(a0.worker_id, 0, zero0, 32, 0.0, a0.incarnation)  # round 0 ends on shard 0
        second.result()
        late = joined[0]
        assert [s.clock for s in late.sessions] == [1, 1]
        late.close()
    finally:
        first.close()
