"""The image built for real (``make image``: deploy/build-image.sh, offline) and the compose
cluster run with it: 2 workers train to the end, ``paramserver status`` answers through the
published port, and a kill -9 of the server's process is survived: the restart policy brings
it back from the checkpoint volume and every batch is applied exactly once.

The cluster comes up with the command docs/deploy.md documents, in the spelling the
installed Compose takes (``docker-compose``, what ``make install`` installs on Debian 12, or
``docker compose`` where the v2 plugin is there), plus only what a test needs: a project
name, ``-d``, ``--no-build``, its worker count and its environment. Tests that need no engine
check the doc against the installed tool.

Needs a Docker engine: the test uses one that answers, or starts ``dockerd`` as root (with
its own data root, removed afterwards) and stops it; it skips, saying why, only where none
can start.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port, paramserver_run
from tests.integration.test_deploy import BASE

# The one docker daemon: one such test at a time under `make test`'s processes.
pytestmark = pytest.mark.xdist_group("docker")

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs/deploy.md"
DOCKER, DOCKERD = shutil.which("docker"), shutil.which("dockerd")
V1, V2 = ("docker-compose",), ("docker", "compose")  # Debian 12's Compose; the v2 plugin
IMAGE = "paramserver:ci"
EPOCHS, BATCHES = 4, 4096 // 64  # synthetic data: 4096 samples, 64 batches an epoch


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """``args`` run from the repository's root (the doc's paths are relative to it)."""
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, f"{' '.join(args)}: {out.stderr[-3000:]}{out.stdout[-2000:]}"
    return out.stdout


def spelling(line: list[str]) -> tuple[str, ...] | None:
    """The Compose spelling a command line starts with, or None for another command."""
    return next((s for s in (V2, V1) if tuple(line[: len(s)]) == s), None)


def documented_blocks() -> list[list[list[str]]]:
    """The compose command lines of each code block in docs/deploy.md's Docker Compose
    section, split as a shell would (comments dropped), one list per block that has any."""
    section = DOC.read_text().split("\n## Docker Compose\n", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", section, re.M | re.S):
        lines = [shlex.split(line, comments=True) for line in block.splitlines()]
        if lines := [line for line in lines if spelling(line)]:
            blocks.append(lines)
    return blocks


def documented_up(spelled: tuple[str, ...]) -> list[str]:
    """The doc's ``up --scale`` line spelled ``spelled``; fails when the doc has none."""
    ups = [
        line
        for block in documented_blocks()
        for line in block
        if spelling(line) == spelled and "up" in line and "--scale" in line
    ]
    assert ups, (
        f"docs/deploy.md's Docker Compose section has no `up --scale` line spelled "
        f"`{' '.join(spelled)}`, the spelling the installed Compose takes"
    )
    return ups[0]


def works(spelled: tuple[str, ...]) -> bool:
    """Whether ``<spelled> version`` runs here."""
    exe = shutil.which(spelled[0])
    if exe is None:
        return False
    try:
        probe = subprocess.run([exe, *spelled[1:], "version"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@functools.cache
def installed() -> tuple[str, ...] | None:
    """The spelling the installed Compose takes: the v2 plugin's where ``docker compose
    version`` answers, else ``docker-compose`` where it runs; None without either."""
    return next((s for s in (V2, V1) if works(s)), None)


def cluster_commands(project: str, workers: int) -> tuple[list[str], list[str]]:
    """The documented ``up --scale`` in the installed spelling with only what a test adds
    (``-p project``; ``-d``, ``--no-build`` and ``worker=<workers>`` after ``up``), and the
    same compose options for the other subcommands (ps, logs, down)."""
    spelled = installed()
    assert spelled is not None and (exe := shutil.which(spelled[0]))
    line = documented_up(spelled)
    at = line.index("up")
    compose = [exe, *spelled[1:], "-p", project, *line[len(spelled) : at]]
    up = line[at + 1 :]
    scale = up.index("--scale") + 1
    assert up[scale].startswith("worker="), f"the documented --scale is not the workers': {line}"
    up[scale] = f"worker={workers}"
    return compose, [*compose, "up", "-d", "--no-build", *up]


def test_the_doc_spells_compose_both_ways():
    """The Docker Compose section gives ``docker-compose`` first (what ``make install``
    installs from Debian 12, which has no v2 plugin), then the same commands spelled
    ``docker compose``; each block in one spelling."""
    packages = re.search(r"^DEB_PACKAGES :=(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert packages and "docker-compose" in packages[1].split()
    blocks = documented_blocks()
    spellings = [{spelling(line) for line in block} for block in blocks]
    assert spellings[:2] == [{V1}, {V2}], f"docs/deploy.md's compose blocks are spelled {spellings}"
    first, second = (
        [line[len(s) :] for line in b] for s, b in zip((V1, V2), blocks[:2], strict=True)
    )
    assert first == second, "the two spellings document different commands"
    up = documented_up(V1)
    assert ROOT / up[up.index("-f") + 1] == BASE  # the file the cluster test runs


def test_the_documented_compose_runs_here():
    """The documented command's spelling is one the installed Compose takes: its executable is
    on PATH and answers ``version``, and the documented files pass ``config --quiet`` (no
    Docker engine needed)."""
    spelled = installed()
    if spelled is None:
        pytest.skip("neither docker-compose nor docker compose runs (make installs docker-compose)")
    line = documented_up(spelled)
    exe = shutil.which(line[0])
    assert exe is not None, f"{line[0]} is not on PATH"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMSERVER_", "TORCH_"))}
    run([exe, *line[1 : line.index("up")], "config", "--quiet"], env=clean)


def answers(env: dict[str, str]) -> bool:
    probe = subprocess.run([DOCKER or "docker", "info"], capture_output=True, env=env, timeout=30)
    return probe.returncode == 0


def wait_for(what: str, check, deadline: float, every: float = 0.5):
    end = time.monotonic() + deadline
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {deadline:.0f} s")
        time.sleep(every)  # polling a daemon we do not control; the deadline bounds it


@pytest.fixture(scope="module")
def docker_env(tmp_path_factory) -> Iterator[dict[str, str]]:
    """The environment that reaches a Docker engine: one already running, or one started here."""
    if DOCKER is None or installed() is None:
        pytest.skip("docker and docker-compose are not installed (make installs docker-compose)")
    env = dict(os.environ)
    if answers(env):
        yield env
        return
    if DOCKERD is None or os.geteuid() != 0:
        pytest.skip("no Docker engine answers, and dockerd cannot be started (needs root)")
    home = tmp_path_factory.mktemp("dockerd")
    # dockerd rewrites iptables (FORWARD policy DROP, its chains): put them back afterwards.
    saved = (
        subprocess.run(["iptables-save"], capture_output=True, timeout=30)
        if shutil.which("iptables-save")
        else None
    )
    had_bridge = (
        subprocess.run(["ip", "link", "show", "docker0"], capture_output=True).returncode == 0
    )
    sock = home / "docker.sock"
    env["DOCKER_HOST"] = f"unix://{sock}"
    log = open(home / "dockerd.log", "wb")  # noqa: SIM115 - closed below
    daemon = subprocess.Popen(
        [
            DOCKERD,
            "--host",
            env["DOCKER_HOST"],
            "--data-root",
            str(home / "data"),
            "--exec-root",
            str(home / "exec"),
            "--pidfile",
            str(home / "dockerd.pid"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        end = time.monotonic() + 60
        while not answers(env):
            if daemon.poll() is not None or time.monotonic() > end:
                tail = (home / "dockerd.log").read_text(errors="replace")[-1500:]
                pytest.skip(f"dockerd could not start: {tail}")
            time.sleep(0.5)
        yield env
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(30)
        log.close()
        if not had_bridge:
            subprocess.run(["ip", "link", "del", "docker0"], capture_output=True, timeout=30)
        if saved is not None and saved.returncode == 0:
            subprocess.run(
                ["iptables-restore"], input=saved.stdout, capture_output=True, timeout=30
            )
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def image(docker_env) -> Iterator[str]:
    """``make image``'s script, tagged ``IMAGE``; removed afterwards (the base stays cached)."""
    env = {**docker_env, "PYTHON": sys.executable}
    started = time.monotonic()
    out = subprocess.run(
        [str(ROOT / "deploy/build-image.sh"), IMAGE],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    print(f"image built in {time.monotonic() - started:.0f} s: {out.stderr.strip()[-300:]}")
    yield IMAGE
    subprocess.run([DOCKER, "rmi", "-f", IMAGE], capture_output=True, env=docker_env, timeout=120)


def test_the_image_runs_the_cli(docker_env, image):
    out = run([DOCKER, "run", "--rm", image, "--version"], env=docker_env)
    assert out.startswith("paramserver")
    # Fashion-MNIST is in the image, where the workers look for it by default
    run(
        [DOCKER, "run", "--rm", "--entrypoint", "ls", image, "/usr/share/datasets/fashion-mnist"],
        env=docker_env,
    )


def test_compose_cluster_trains_and_survives_kill_9_of_the_server(docker_env, image, tmp_path):
    port, metrics = free_port(), free_port()
    settings = {
        "PARAMSERVER_IMAGE": image,
        "PARAMSERVER_DATASET": "synthetic",
        "PARAMSERVER_POLICY": "sync",
        "PARAMSERVER_EPOCHS": str(EPOCHS),
        "PARAMSERVER_WORKERS": "2",
        "PARAMSERVER_MIN_WORKERS": "2",
        "PARAMSERVER_CHECKPOINT_EVERY": "10",
        "PARAMSERVER_STEP_DELAY": "0.05",
        "PARAMSERVER_PUBLISH_PORT": str(port),
        "PARAMSERVER_METRICS_PUBLISH_PORT": str(metrics),
        "PARAMSERVER_LR": "0.003",
    }
    env = {k: v for k, v in docker_env.items() if not k.startswith("PARAMSERVER_")}
    env.update(settings)
    compose, up = cluster_commands(f"pstest{os.getpid()}", workers=2)  # docs/deploy.md's
    address = f"127.0.0.1:{port}"

    def status() -> dict | None:
        out = paramserver_run(
            "status", "--server", address, "--json", "--rpc-timeout", "2", timeout=30
        )
        return json.loads(out.stdout) if out.returncode == 0 else None

    def container(service: str, index: int = 1) -> dict:
        name = run([*compose, "ps", "-q", service], env=env).split()[index - 1]
        return json.loads(run([DOCKER, "inspect", name], env=env))[0]

    started = time.monotonic()
    try:
        run(up, env=env, timeout=300)
        first = wait_for(
            "training under way, past a checkpoint",
            lambda: (s := status()) and s.get("version", 0) >= 30 and s,
            180,
        )
        up_after = time.monotonic() - started
        server = container("server")
        os.kill(server["State"]["Pid"], signal.SIGKILL)  # the host's view of its process
        back = wait_for(
            "the server back from its checkpoint",
            lambda: (s := status()) and s["incarnation"] != first["incarnation"] and s,
            180,
        )
        assert back["version"] >= 30  # it resumed, not started over
        for i in (1, 2):
            wait_for(
                f"worker {i} done",
                lambda i=i: container("worker", i)["State"]["Status"] == "exited",
                300,
            )
            assert container("worker", i)["State"]["ExitCode"] == 0
        final = status()
        assert final is not None and container("server")["RestartCount"] >= 1
        # every batch applied exactly once, across the kill
        assert final["batches_done"] == EPOCHS * BATCHES
        assert final["samples"] == EPOCHS * BATCHES * 64
        assert final["version"] == EPOCHS * BATCHES // 2  # sync: one step per round of 2
        print(
            f"compose: training after {up_after:.0f} s, all done after "
            f"{time.monotonic() - started:.0f} s"
        )
    except BaseException:
        logs = subprocess.run(
            [*compose, "logs", "--no-color", "--tail", "40"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        print(logs.stdout[-6000:])
        raise
    finally:
        subprocess.run(
            [*compose, "down", "-v", "--timeout", "10"],
            env=env,
            capture_output=True,
            timeout=180,
            cwd=ROOT,
        )
