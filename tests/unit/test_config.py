"""Validation of the frozen settings."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from paramserver.config import LaunchConfig, OptimizerConfig, ServerConfig, WorkerConfig
from paramserver.errors import ConfigError
from paramserver.policy.staleness import Policy


def test_defaults_are_valid() -> None:
    opt = OptimizerConfig()
    assert opt.name == "adam" and opt.lr > 0
    server = ServerConfig()
    assert server.parsed_policy == Policy(1)
    assert server.workers >= 1
    worker = WorkerConfig(server="127.0.0.1:50051")
    assert worker.device == "auto"
    launch = LaunchConfig(server=server)
    assert launch.server is server


def test_configs_are_frozen() -> None:
    cfg = ServerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workers = 3  # type: ignore[misc]


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_optimizer_names(name: str) -> None:
    assert OptimizerConfig(name).name == name


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"name": "rmsprop"}, "'rmsprop'"),
        ({"lr": 0.0}, "--lr"),
        ({"lr": -1e-3}, "--lr"),
        ({"lr": math.nan}, "--lr"),
        ({"momentum": -0.1}, "--momentum"),
        ({"weight_decay": -1.0}, "--weight-decay"),
    ],
)
def test_optimizer_bad_values(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        OptimizerConfig(**kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"workers": 0}, ["--workers", "0"]),
        ({"workers": -2}, ["--workers", "-2"]),
        # The policy and dataset messages name the setting in words, not as an option.
        ({"policy": "bogus"}, ["policy", "'bogus'"]),
        ({"policy": "ssp:0"}, ["policy", "'ssp:0'"]),
        ({"dataset": "imagenet"}, ["dataset", "'imagenet'"]),
        ({"batch_size": 0}, ["--batch-size", "0"]),
        ({"epochs": 0}, ["--epochs", "0"]),
        ({"port": 70000}, ["--port", "70000"]),
        ({"port": -1}, ["--port", "-1"]),
        ({"lease_seconds": 0.0}, ["--lease-timeout"]),
        ({"chunk_bytes": 1000}, ["--chunk-bytes", "1000"]),
        ({"chunk_bytes": 4098}, ["--chunk-bytes", "4098"]),
        ({"threads": 0}, ["--server-threads", "0"]),
        ({"barrier_timeout": 0.0}, ["--barrier-timeout"]),
    ],
)
def test_server_bad_values(kwargs: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        ServerConfig(**kwargs)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"port": 0},
        {"port": 65535},
        {"chunk_bytes": 4096},
        {"policy": "sync"},
        {"policy": "async"},
        {"policy": "ssp:3"},
        {"dataset": "synthetic"},
        {"workers": 16},
    ],
)
def test_server_boundary_values_accepted(kwargs: dict[str, Any]) -> None:
    cfg = ServerConfig(**kwargs)
    for key, value in kwargs.items():
        assert getattr(cfg, key) == value


def test_server_parsed_policy() -> None:
    assert ServerConfig(policy="sync").parsed_policy.synchronous
    assert ServerConfig(policy="async").parsed_policy.bound is None
    assert ServerConfig(policy="delay-3").parsed_policy.name == "ssp:3"


@pytest.mark.parametrize(
    "server", ["127.0.0.1:50051", "localhost:1", "unix:/tmp/ps.sock", "[::1]:50051"]
)
def test_worker_server_addresses_accepted(server: str) -> None:
    assert WorkerConfig(server=server).server == server


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_worker_devices_accepted(device: str) -> None:
    assert WorkerConfig(server="h:1", device=device).device == device


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"server": "nohost"}, "--server"),
        ({"server": "host:port"}, "--server"),
        ({"server": ""}, "--server"),
        ({"server": "a b:1"}, "--server"),
        ({"server": "h:1", "device": "tpu"}, "--device"),
        ({"server": "h:1", "device": "cuda:"}, "--device"),
        ({"server": "h:1", "threads": 0}, "--threads"),
        ({"server": "h:1", "rpc_timeout": 0.0}, "--rpc-timeout"),
        ({"server": "h:1", "barrier_timeout": -1.0}, "--barrier-timeout"),
        ({"server": "h:1", "max_steps": 0}, "--max-steps"),
        ({"server": "h:1", "step_delay": -0.5}, "--step-delay"),
    ],
)
def test_worker_bad_values(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        WorkerConfig(**kwargs)
    assert needle in str(info.value)


def test_worker_bad_values_name_the_value() -> None:
    with pytest.raises(ConfigError) as info:
        WorkerConfig(server="nohost")
    assert "'nohost'" in str(info.value)
    with pytest.raises(ConfigError) as info:
        WorkerConfig(server="h:1", device="tpu")
    assert "'tpu'" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"device": "tpu"}, "--device"),
        ({"threads": 0}, "--threads"),
        ({"step_delay": -1.0}, "--step-delay"),
        ({"startup_timeout": 0.0}, "--startup-timeout"),
    ],
)
def test_launch_bad_values(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        LaunchConfig(server=ServerConfig(), **kwargs)
    assert needle in str(info.value)


def test_config_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        ServerConfig(workers=0)


@pytest.mark.parametrize(
    ("text", "parsed"), [("500", (500, None)), ("30s", (None, 30.0)), ("5m", (None, 300.0))]
)
def test_checkpoint_every_takes_steps_or_seconds(text: str, parsed: tuple) -> None:
    from paramserver.config import parse_every

    assert parse_every(text) == parsed


@pytest.mark.parametrize("text", ["0", "0s", "1.5", "-3", "soon", ""])
def test_checkpoint_every_rejects_nonsense(text: str) -> None:
    with pytest.raises(ConfigError, match="--checkpoint-every"):
        ServerConfig(checkpoint_every=text)


def test_min_workers_must_fit_in_workers() -> None:
    assert ServerConfig(workers=4, min_workers=2).start_workers == 2
    assert ServerConfig(workers=4).start_workers == 4
    with pytest.raises(ConfigError, match="--min-workers"):
        ServerConfig(workers=2, min_workers=3)


def test_security_needs_readable_files_and_never_prints_the_token(tmp_path) -> None:
    from paramserver.config import Security

    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match="go together"):
        Security(cert=str(cert))
    with pytest.raises(ConfigError, match="not a readable file"):
        Security(cert=str(cert), key=str(tmp_path / "missing.key"))
    assert "hunter2" not in repr(Security(token="hunter2"))
    assert "hunter2" not in repr(ServerConfig(security=Security(token="hunter2")))
