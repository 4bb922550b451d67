"""Refusals that name the right thing: the file and why it cannot be read, both models of
a mismatch, the model a snapshot was asked to load into, a health service a server lacks.
Each is one sentence (no traceback, no torch state-dict listing)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

import paramserver as ps
from paramserver.errors import ConfigError
from paramserver.server.app import CHECKPOINT_HEALTH
from paramserver.server.disk import checkpoint
from paramserver.server.disk.reshard import reshard
from paramserver.serving import snapshot
from tests.conftest import DEADLINE, cli, tiny_model
from tests.integration.test_export import MODEL, SEED, _train


def test_a_cut_short_checkpoint_is_named_with_its_size_and_the_likely_cause(serve, tmp_path):
    """A cut half-written (a copy cut short) during ``checkpoint reshard`` said only
    "[Errno 22] Invalid argument"."""
    run = tmp_path / "run"
    _train(serve, run, 2)
    cut = run / checkpoint.cut_file(1, 2, 10)
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    size = cut.stat().st_size
    with pytest.raises(ConfigError) as info:
        reshard(run, MODEL, SEED, 3, out=tmp_path / "three", round_=10)
    why = str(info.value)
    assert f"Cannot read the checkpoint {cut} ({size} bytes): it is cut short or corrupt" in why
    assert "\n" not in why and not (tmp_path / "three").exists()
    out = cli(
        *("checkpoint", "reshard", str(run), "--model", MODEL, "--seed", str(SEED)),
        *("--shards", "3", "--round", "10", "--out", str(tmp_path / "three")),
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "cut short or corrupt" in out.stderr and str(cut) in out.stderr


def test_a_checkpoint_of_another_model_names_both_models_and_the_file_once(serve, tmp_path):
    first = serve("mlp", policy="async", checkpoint_dir=str(tmp_path))
    first.stop()
    with pytest.raises(ConfigError) as info:
        serve("cnn", policy="async", checkpoint_dir=str(tmp_path))
    why = str(info.value)
    path = tmp_path / checkpoint.SERVER_FILE
    assert why.startswith(
        f"{path} was written by a server of --model mlp and does not match --model cnn: Parameter"
    ), why
    assert why.count(str(path)) == 1


def test_a_snapshot_loaded_into_another_model_names_the_model_given_in_one_line(serve, tmp_path):
    """It gave torch's many-line state-dict error and named the snapshot's model."""
    _train(serve, tmp_path / "run", 1)
    root, _, _ = snapshot.write(tmp_path / "run", MODEL, SEED, tmp_path / "snap")
    other = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(ConfigError) as info:
        ps.serving.load(root, model=other)
    why = str(info.value)
    assert why.startswith(
        f"The snapshot in {root} (of model {MODEL!r}) does not load into the model given "
        "(Sequential): missing '0.weight', '0.bias'; unexpected"
    ), why
    assert "\n" not in why


def test_a_health_service_the_server_lacks_is_named_with_why(serve):
    """--service paramserver.v1.Checkpoints without --checkpoint-dir answered NOT_FOUND
    with an empty text."""
    server = serve(tiny_model(), policy="async")
    channel = grpc.insecure_channel(server.address)
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service=CHECKPOINT_HEALTH), timeout=DEADLINE)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no --checkpoint-dir" in err.value.details(), err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=DEADLINE)
        assert "No health service 'nope' here; it has ''" in err.value.details()
        ok = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=DEADLINE)
        assert ok.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
    out = cli("health", "--server", server.address, "--service", CHECKPOINT_HEALTH)
    assert out.returncode != 0 and "no --checkpoint-dir" in out.stderr, out.stderr


def test_a_checkpoint_names_the_model_of_the_server_that_wrote_it(serve, tmp_path):
    named = serve("mlp", policy="async", checkpoint_dir=str(tmp_path / "named"))
    named.stop()
    assert checkpoint.load(tmp_path / "named" / checkpoint.SERVER_FILE)["model"] == "mlp"
    given = serve(tiny_model(), policy="async", checkpoint_dir=str(tmp_path / "given"))
    given.stop()
    assert checkpoint.load(tmp_path / "given" / checkpoint.SERVER_FILE)["model"] == ""


def test_an_unverified_snapshot_with_a_torn_dense_file_is_one_line(serve, tmp_path):
    _train(serve, tmp_path / "run", 1)
    root, _, _ = snapshot.write(tmp_path / "run", MODEL, SEED, tmp_path / "snap")
    dense = root / "dense.pt"
    dense.write_bytes(dense.read_bytes()[:100])
    with pytest.raises(ConfigError) as info:
        ps.serving.load(root, verify=False)
    assert f"cannot read {dense}" in str(info.value) and "\n" not in str(info.value)


def test_a_long_health_service_name_is_quoted_short(serve):
    server = serve(tiny_model(), policy="async")
    channel = grpc.insecure_channel(server.address)
    try:
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="x" * 10_000), timeout=DEADLINE
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "(10000 characters)" in err.value.details() and len(err.value.details()) < 300
    finally:
        channel.close()
