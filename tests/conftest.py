"""Shared fixtures: in-process servers on port 0, small models, worker threads with deadlines."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import paramserver as ps
from paramserver.cluster import procs
from paramserver.cluster.zygote import Forked
from tests import cpu_account

DEADLINE = 120.0  # seconds any single wait in a test may take before it fails

# `make test` runs the suite on several processes (pytest-xdist, ``--dist loadgroup``;
# servers bind port 0, every test has its own tmp_path). A test that uses a machine-wide
# resource is marked ``xdist_group(NAME)``, so that tests of one group run one at a time on
# one process: "netns" (network namespaces on one fixed subnet, which some tests count
# machine-wide), "docker" (the one daemon), "slurm" (its daemons) and "bench" (the quick
# benchmarks, whose short windows other benchmarks beside them starve).


def pytest_configure(config: pytest.Config) -> None:
    cpu_account.register(config)
    # a suite started as a background job ignores SIGINT, and so would every child it
    # starts (exec'd or forked): the tests that stop one with ^C would fail there alone
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The machine, last: the suite's time depends on it (about twice as long on the 2-core
    Intel Xeon as on the 2-core AMD EPYC), and CI's log keeps only its tail."""
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    terminalreporter.write_line(f"machine: {model}, {os.cpu_count()} CPUs")


class FakeClock:
    """An injectable monotonic clock that moves only when told to."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def tiny_model(seed: int = 0) -> nn.Module:
    """A small MLP for 28x28 inputs, fast enough for many steps in a test."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))


@pytest.fixture
def serve() -> Iterator[Callable[..., ps.ServerApp]]:
    """Start servers with ``ps.serve(...)`` on port 0; all are stopped after the test."""
    servers: list[ps.ServerApp] = []

    def start(model: Any = "mlp", **kwargs: Any) -> ps.ServerApp:
        kwargs.setdefault("port", 0)
        server = ps.serve(model, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace=0)


class WorkerThread(threading.Thread):
    """Runs ``body()`` in a thread and re-raises its exception in ``result()``."""

    def __init__(self, body: Callable[[], Any], name: str = "worker"):
        super().__init__(name=name, daemon=True)
        self._body = body
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self._body()
        except BaseException as exc:  # noqa: BLE001 - re-raised in result()
            self.error = exc

    def result(self, timeout: float = DEADLINE) -> Any:
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"{self.name} did not finish within {timeout}s")
        if self.error is not None:
            raise self.error
        return self.value


def replica(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def sync_workers(
    address: str,
    model: nn.Module,
    batch: Batch,
    steps: int,
    workers: int,
    train_samples: int,
    **worker: Any,
) -> list[dict[str, torch.Tensor]]:
    """``workers`` threads, each a replica of ``model`` taking ``steps`` cross-entropy steps
    on ``batch(b)`` of the batches the server hands it (a ``Worker`` with the options
    ``worker``); their final state dicts."""

    def train() -> dict[str, torch.Tensor]:
        local = replica(model)
        with ps.Worker(address, local, train_samples=train_samples, **worker) as w:
            for _ in range(steps):
                assert w.batch is not None
                x, y = batch(w.batch)
                torch.nn.functional.cross_entropy(local(x), y).backward()
                w.step(samples=len(x))
        return {k: v.clone() for k, v in local.state_dict().items()}

    threads = [WorkerThread(train, f"worker-{i}") for i in range(workers)]
    for t in threads:
        t.start()
    return [t.result() for t in threads]


def local_sgd(model: nn.Module, batch: Batch, steps: int, lr: float) -> nn.Module:
    """A copy of ``model`` after ``steps`` plain SGD steps of cross-entropy on ``batch(t)``:
    what one worker under ``sync`` with SGD must end with."""
    ref = replica(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    return ref


def assert_same_state(got: nn.Module, want: nn.Module, rtol: float, atol: float) -> None:
    """Every parameter and buffer of ``got`` close to ``want``'s, named where not."""
    pairs = zip(got.state_dict().items(), want.state_dict().values(), strict=True)
    for (name, a), b in pairs:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=name)


def large_batch_reference(
    model: nn.Module,
    optimizer: Callable[[list], torch.optim.Optimizer],
    batch: Batch,
    steps: int,
    workers: int,
) -> nn.Module:
    """What ``sync`` with ``workers`` workers should equal: one process whose step t takes
    the batches of round t together (the server hands batches out in order, so round t is
    batches workers*t ... workers*t + workers - 1)."""
    ref = replica(model)
    opt = optimizer(list(ref.parameters()))
    for step in range(steps):
        xs, ys = zip(*(batch(workers * step + r) for r in range(workers)), strict=True)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return ref


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen]]:
    """Child processes started by a test; every one is killed afterwards."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def free_port() -> int:
    """A port free on 127.0.0.1 now (for a process that must be told its port up front)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ones_step(worker: ps.Worker, model: nn.Module, samples: int = 1) -> None:
    """One step of ``worker`` with every gradient of ``model`` all ones."""
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    worker.step(samples=samples)


def cli(*args: str, timeout: float = DEADLINE) -> subprocess.CompletedProcess[str]:
    """``paramserver ARGS`` in a child process, its output captured."""
    return paramserver_run(*args, timeout=timeout)


def paramserver_popen(*args: str, **kwargs: Any) -> subprocess.Popen | Forked:
    """``subprocess.Popen(paramserver_cmd(*args), **kwargs)``, forked from the suite's zygote
    (a process of its own, as fast to start as a fork: see ``paramserver.cluster.zygote``).
    Takes stdin, stdout, stderr, env, cwd, start_new_session and text."""
    return procs.start(paramserver_cmd(*args), **kwargs)


def paramserver_run(
    *args: str, timeout: float = DEADLINE, capture: bool = True, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(paramserver_cmd(*args), capture_output=capture, text=True, ...)``
    through the zygote: killed on ``timeout`` (then TimeoutExpired)."""
    return procs.run(paramserver_cmd(*args), timeout, capture, **kwargs)


def wait_until(check: Callable[[], bool], what: str) -> None:
    """Wait for ``check()`` with DEADLINE (a few checks a second no sooner than needed);
    fail naming ``what``."""
    ends, tick = time.monotonic() + DEADLINE, threading.Event()
    while not check():
        assert time.monotonic() < ends, f"still not {what} after {DEADLINE:g} s"
        tick.wait(0.02)


def paramserver_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "paramserver", *args]


def launch_json(
    runs_dir: Path, *args: str, timeout: float = 600
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """``paramserver launch ARGS --device cpu --json --no-progress --runs-dir RUNS_DIR``, which
    must succeed: its summary line and the finished process."""
    out = paramserver_run(
        "launch",
        *args,
        *("--device", "cpu", "--json", "--no-progress", "--runs-dir", str(runs_dir)),
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out


def launch_clicks(
    runs_dir: Path, model: str
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """``launch_json`` of ``model`` on the click log: 1 epoch, batch 256, 2 workers."""
    return launch_json(
        runs_dir,
        *("--model", model, "--dataset", "clicks", "--epochs", "1", "--batch-size", "256"),
        *("--lr", "0.01", "--workers", "2"),
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """A CA, a server and a client certificate it signed, and a client it did not sign."""
    from tests.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))
