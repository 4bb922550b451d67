"""The Python API: serve, Worker, step, close, status; and its errors."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from paramserver.training import data
from paramserver.training.evaluation import evaluate
from tests.conftest import WorkerThread, replica, tiny_model


def test_training_loop_through_the_api_learns(serve):
    ds = data.synthetic(train=2048, test=512)
    model = tiny_model()
    server = serve(replica(model), optimizer="adam", lr=3e-3, policy="delay-1", workers=1)
    before = evaluate(model, ds.test_x, ds.test_y).accuracy
    with ps.Worker(server.address, model) as worker:
        for _epoch in range(3):
            for i in range(0, 2048, 64):
                x, y = ds.train_x[i : i + 64], ds.train_y[i : i + 64]
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                worker.step(samples=len(x), loss=loss.item())
        assert worker.clock == 3 * 32
    after = evaluate(model, ds.test_x, ds.test_y).accuracy
    status = server.status()
    assert status["pushes_applied"] == 96
    assert status["samples"] == 96 * 64
    assert status["version"] == 96
    assert status["max_staleness"] <= 1
    assert after > before + 0.2, (before, after)


def test_worker_builds_the_model_the_server_names(serve):
    server = serve("mlp", seed=3)
    with ps.Worker(server.address) as worker:
        assert worker.plan.model == "mlp"
        expected = ps.models.build("mlp", seed=3)
        for a, b in zip(worker.model.parameters(), expected.parameters(), strict=True):
            assert torch.equal(a, b)


def test_a_model_that_does_not_match_is_refused_with_the_parameter_named(serve):
    server = serve("mlp")
    wrong = nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 255),
        nn.ReLU(),
        nn.Linear(255, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )
    with pytest.raises(ps.ConfigError, match=r"Parameter '1\.weight'"):
        ps.Worker(server.address, wrong)
    assert server.status()["workers"] == []  # it left again


def test_more_workers_than_the_server_admits_are_refused(serve):
    server = serve("mlp", workers=1)
    with (
        ps.Worker(server.address),
        pytest.raises(
            ps.ClusterFull, match=r"started for 1 workers.*Still so after 1s \(--server-timeout\)"
        ),
    ):
        ps.Worker(server.address, server_timeout=1.0)


def test_a_worker_waits_for_a_slot_to_free(serve, caplog):
    """A replacement that arrives while the cluster is full (a dead worker's lease still
    running, a requeued job meeting its checkpointed workers) joins once a slot frees."""
    server = serve("mlp", workers=1)
    first = ps.Worker(server.address)
    second = WorkerThread(lambda: ps.Worker(server.address, server_timeout=60.0))
    with caplog.at_level(logging.WARNING, logger="paramserver.worker.session"):
        second.start()
        deadline = time.monotonic() + 30
        while "retrying for up to 60s" not in caplog.text:  # it met the full cluster
            assert time.monotonic() < deadline and second.is_alive(), caplog.text
            time.sleep(0.01)  # polling the log of another thread; bounded by the deadline
    first.close()
    joined = second.result()
    assert [w["name"] for w in server.status()["workers"]] == [joined.name]
    joined.close()


def test_unreachable_server_fails_fast_with_a_clear_error():
    with pytest.raises(ps.ServerUnavailable, match="No parameter server answered at 127.0.0.1:1"):
        ps.Worker("127.0.0.1:1", tiny_model(), connect_timeout=0.5)


def test_bad_policy_is_refused_before_anything_starts():
    with pytest.raises(ps.ConfigError, match=r"Unknown staleness policy \(--policy\) 'ssp:0'"):
        ps.serve("mlp", policy="ssp:0", port=0)


def test_checkpoint_of_a_launch_loads_into_the_model(serve, tmp_path):
    from paramserver import models
    from paramserver.codec import layout
    from paramserver.server.disk import checkpoint

    server = serve("resnet", seed=5)
    c = server.coordinator
    state = layout.state_dict(c.manifest, c.store.weights)
    path = checkpoint.save(tmp_path / "ck.pt", state, version=c.store.version)
    loaded = torch.load(path, weights_only=True)
    model = models.build("resnet")
    model.load_state_dict(loaded["model_state_dict"], strict=True)  # parameters and buffers
    built = models.build("resnet", seed=5).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, built[name]) and value.dtype == built[name].dtype, name
    assert loaded["format"] == checkpoint.FORMAT
    assert models.state(model)[0] == c.manifest


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_decides_whether_a_worker_reads_its_own_last_push(serve, overlap):
    model = tiny_model()
    server = serve(replica(model), optimizer="sgd", lr=0.1, policy="async", workers=1)
    with ps.Worker(server.address, model, overlap=overlap) as worker:
        assert worker.overlap is overlap
        for step in range(5):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            worker.step(samples=1)
            if not overlap:
                # The push was answered before the pull, so the weights hold it.
                assert worker.version == step + 1
        worker.flush()
    assert server.status()["version"] == 5


def test_overlap_defaults_to_off_on_cpu(serve):
    server = serve("mlp")
    with ps.Worker(server.address) as worker:
        assert worker.device.type == "cpu"
        assert worker.overlap is False


def test_a_worker_whose_server_does_not_come_back_fails_after_server_timeout(serve):
    from paramserver.errors import ServerUnavailable

    model = tiny_model()
    server = serve(replica(model), policy="async")
    worker = ps.Worker(server.address, model, server_timeout=1.0)
    server.stop(grace=0)
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    with pytest.raises(ServerUnavailable, match="did not come back within 1s"):
        worker.step()
    worker.close_quietly()


def test_the_log_names_the_address_the_server_is_bound_to(serve, caplog):
    with caplog.at_level(logging.INFO, logger="paramserver.server.app"):
        server = serve("mlp", host="0.0.0.0")
    port = server.address.rsplit(":", 1)[1]
    assert f"on 0.0.0.0:{port} (every interface; dial 127.0.0.1:{port} on this host)" in caplog.text


def test_serve_takes_a_whole_config_and_settings_that_replace_its_fields(serve):
    base = ps.ServerConfig(
        policy="sync",
        workers=2,
        batch_size=32,
        host="127.0.0.1",
        optimizer=ps.OptimizerConfig("sgd", 0.5, momentum=0.0),
    )
    server = serve(config=base, lr=0.25, seed=4)
    assert server.config == dataclasses.replace(
        base, port=0, seed=4, optimizer=ps.OptimizerConfig("sgd", 0.25, momentum=0.0)
    )
    assert server.status()["policy"] == "sync"
    # a whole OptimizerConfig also goes under optimizer=
    whole = ps.OptimizerConfig("momentum", 0.1)
    assert serve("cnn", optimizer=whole).config.optimizer == whole


def test_serve_without_settings_is_the_configs_defaults_on_this_host_and_any_port(serve):
    server = serve()
    assert server.config == ps.ServerConfig(host="127.0.0.1", port=0)
    assert server.address.startswith("127.0.0.1:") and server.port > 0
