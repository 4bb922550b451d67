"""deploy/: the compose files validate with docker-compose's own `config`, use only real
options, and their topology trains for real across network namespaces."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from paramserver.cli import cli
from tests import netns
from tests.conftest import DEADLINE

# Network namespaces on one fixed subnet, counted machine-wide: one such test at a time
# under `make test`'s processes (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("netns")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE, GPU, ENV_EXAMPLE = (
    DEPLOY / "docker-compose.yml",
    DEPLOY / "docker-compose.gpu.yml",
    DEPLOY / ".env.example",
)
COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(
    COMPOSE is None,
    reason="docker-compose is not installed (Debian package docker-compose; make installs it as root)",
)


def compose_config(tmp_path: Path, *files: Path, env: dict[str, str] | None = None) -> dict:
    """The compose files as docker-compose resolves them, with ``env`` as the .env file."""
    env_file = tmp_path / "compose.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in (env or {}).items()))
    args = [COMPOSE, "--env-file", str(env_file)]
    for f in files:
        args += ["-f", str(f)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMSERVER_", "TORCH_"))}
    out = subprocess.run([*args, "config"], capture_output=True, text=True, env=clean, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def cli_envvars() -> dict[str, set[str]]:
    """PARAMSERVER_* variables each command reads (the group's --log-level counts for all)."""
    common = {p.envvar for p in cli.params if p.envvar}
    return {
        name: common | {p.envvar for p in cmd.params if isinstance(p.envvar, str)}
        for name, cmd in cli.commands.items()
    }


@needs_compose
@pytest.mark.parametrize(
    "files,env_example",
    [((BASE,), False), ((BASE, GPU), False), ((BASE,), True), ((BASE, GPU), True)],
)
def test_compose_files_validate(tmp_path, files, env_example):
    env = dict(re.findall(r"^(\w+)=(.*)$", ENV_EXAMPLE.read_text(), re.M)) if env_example else {}
    config = compose_config(tmp_path, *files, env=env)
    assert set(config["services"]) == {"server", "worker"}


@needs_compose
def test_compose_topology(tmp_path):
    services = compose_config(tmp_path, BASE)["services"]
    server, worker = services["server"], services["worker"]
    assert server["healthcheck"]["test"][1:3] == ["paramserver", "health"]
    assert worker["depends_on"]["server"]["condition"] == "service_healthy"
    assert (server["restart"], worker["restart"]) == ("unless-stopped", "on-failure")
    assert any(v.startswith("checkpoints:/checkpoints") for v in server["volumes"])
    assert any(v.startswith("data:/data") for v in worker["volumes"])
    assert server["environment"]["PARAMSERVER_CHECKPOINT_DIR"] == "/checkpoints"
    assert worker["environment"]["PARAMSERVER_SERVER"] == "server:50051"
    gpu = compose_config(tmp_path, BASE, GPU)["services"]["worker"]
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    assert device["count"] == 1  # an integer, as the engine wants, not the string '1'
    assert gpu["environment"]["PARAMSERVER_DEVICE"] == "cuda"


def test_deploy_files_name_only_real_options():
    envvars = cli_envvars()
    raw = yaml.safe_load(BASE.read_text())["services"]
    for service in ("server", "worker"):
        unknown = set(raw[service]["environment"]) - envvars[service]
        assert not unknown, (
            f"{service} sets variables paramserver {service} does not read: {unknown}"
        )
    compose_vars = set(re.findall(r"\$\{(\w+)", BASE.read_text() + GPU.read_text()))
    every = set().union(*envvars.values())
    for key in re.findall(r"^#?\s*(\w+)=", ENV_EXAMPLE.read_text(), re.M):
        assert key in every or key in compose_vars, f".env.example sets {key}, which nothing reads"


@needs_compose
def test_compose_cluster_trains_across_network_namespaces(tmp_path):
    """The compose topology for real: a server and 2 workers, each in its own namespace."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    run_env = {
        "PARAMSERVER_DATASET": "synthetic",
        "PARAMSERVER_EPOCHS": "1",
        "PARAMSERVER_WORKERS": "2",
        "PARAMSERVER_MIN_WORKERS": "2",
        "PARAMSERVER_CHECKPOINT_EVERY": "20",
        "PARAMSERVER_LOG_LEVEL": "info",
    }
    services = compose_config(tmp_path, BASE, env=run_env)["services"]

    def process(service: dict) -> tuple[list[str], dict[str, str]]:
        """The service's entrypoint + command and environment, volumes mapped to folders."""
        argv = [*service.get("entrypoint", []), *service.get("command", [])]
        assert argv[0] == "paramserver"
        env = {k: str(v) for k, v in service.get("environment", {}).items()}
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            folder = tmp_path / "volumes" / source
            folder.mkdir(parents=True, exist_ok=True)
            env = {
                k: v.replace(target, str(folder)) if v.startswith(target) else v
                for k, v in env.items()
            }
        base = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSERVER_")}
        return [sys.executable, "-m", *argv], {**base, **env}

    hosts = ["server", "worker-1", "worker-2"]  # docker compose up --scale worker=2
    net = netns.Network(hosts)
    try:
        argv, env = process(services["server"])
        server = net.run("server", argv, env, tmp_path / "server.log")
        # depends_on: service_healthy -- run the healthcheck until it passes
        check = services["server"]["healthcheck"]["test"][1:]
        check_argv = [sys.executable, "-m", *check]
        deadline = time.monotonic() + DEADLINE
        while net.call("server", check_argv, env, 30).returncode != 0:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server never became healthy"
        workers = []
        for host in hosts[1:]:
            argv, env = process(services["worker"])
            workers.append(net.run(host, argv, env, tmp_path / f"{host}.log"))
        for host, proc in zip(hosts[1:], workers, strict=True):
            assert proc.wait(DEADLINE) == 0, (tmp_path / f"{host}.log").read_text()[-3000:]

        status_argv = [
            sys.executable,
            "-m",
            "paramserver",
            "status",
            "--json",
            "--server",
            "127.0.0.1:50051",
        ]
        out = net.call("server", status_argv, env, 60)
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        assert st["batches_done"] == st["batches_total"] == 64
        assert st["workers_joined"] == 2
        # the workers reached the server by its service name, across the bridge
        for host in hosts[1:]:
            assert "joined server:50051" in (tmp_path / f"{host}.log").read_text()

        server.terminate()  # as docker stop does: SIGTERM, then a last checkpoint
        assert server.wait(DEADLINE) == 0, (tmp_path / "server.log").read_text()[-3000:]
        assert (tmp_path / "volumes" / "checkpoints" / "server-checkpoint.pt").exists()
    finally:
        net.close()
