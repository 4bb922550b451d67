"""What every benchmark shares: timing, a server in a child process, the report."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from paramserver._proto import paramserver_pb2 as pb
from paramserver.cluster.commands import CHILD_ENV, server_args, worker_command
from paramserver.cluster.procs import READY_MARKER, Child, stop_all
from paramserver.config import OptimizerConfig, ServerConfig, WorkerConfig
from paramserver.policy.staleness import Policy
from paramserver.transport.stub import Stub, connect


def median_seconds(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    """The median wall time of ``fn()`` over ``reps`` runs, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@contextmanager
def server_process(cfg: ServerConfig, timeout: float = 120.0) -> Iterator[str]:
    """A ``paramserver server`` child with ``cfg`` on a free loopback port; yields its
    address."""
    with server_child(cfg, timeout) as (address, _):
        yield address


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system) of process ``pid`` so far, threads that ended included
    (Linux /proc, in clock ticks: measure over seconds, not milliseconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def server_child(cfg: ServerConfig, timeout: float = 120.0) -> Iterator[tuple[str, Child]]:
    """``server_process``, yielding its address and the child (for its pid)."""
    args = server_args(dataclasses.replace(cfg, host="127.0.0.1", port=0))
    with tempfile.TemporaryDirectory(prefix="paramserver-bench-") as tmp:
        child = Child(
            "bench-server",
            args,
            Path(tmp) / "server.log",
            capture_stdout=True,
            env=CHILD_ENV,
        )
        try:
            line = child.wait_for_line(READY_MARKER, timeout)
            yield line.rsplit(" ", 1)[-1], child
        finally:
            child.stop()


def _sample(stub: Stub, server: int, workers: list[int]) -> tuple[float, Any, tuple[float, float]]:
    """Now, the server's status and the CPU seconds of the server and of the workers."""
    now, status = time.perf_counter(), stub.Status(pb.StatusRequest(), timeout=30)
    return now, status, (cpu_seconds(server), sum(cpu_seconds(p) for p in workers))


def _wait_until_training(stub: Stub, children: list[Any], policy: str) -> None:
    """Until the server counts a sample (120 s at most, and while every worker runs)."""
    deadline = time.monotonic() + 120
    while stub.Status(pb.StatusRequest(), timeout=30).samples == 0:
        if time.monotonic() > deadline or any(c.poll() is not None for c in children):
            raise RuntimeError(f"the {policy} run did not start: {children[0].tail()}")
        time.sleep(0.1)


# A window in which nothing was applied (a short --quick window on a host loaded by other
# work) goes on until something is, up to this long: the rate is then over the time taken.
STALLED_WINDOW_S = 60.0


def cluster_rate(
    policy: str,
    delays: list[float],
    batch: int,
    warmup: float,
    window: float,
    logs: Path,
    shm: str = "on",
    optimizer_thread: bool = False,
    backups: int = 0,
    cpu: dict[str, float] | None = None,
    model: str = "mlp",
    device: str = "cpu",
    local_steps: int = 0,
) -> tuple[float, list[float]]:
    """Samples/s of a server (``optimizer_thread``, ``backups``: its settings) and a worker
    process per entry of ``delays`` (its per-step sleep; ``shm`` its --shm) over ``window``
    seconds once all have started, by the server's counters: the total and each worker's.
    ``cpu`` gets the CPU seconds of the server and the workers (``server_s``,
    ``workers_s``) and the steps taken in the window. ``model``: the run's model; ``device``:
    the workers' --device (all of them on the one GPU with cuda); ``local_steps`` H: the
    workers take H local AdamW steps a push under the server's ``local_outer``."""
    cfg = ServerConfig(
        model=model,
        optimizer=local_outer(policy) if local_steps else OptimizerConfig("adam"),
        policy=policy,
        workers=len(delays),
        dataset="synthetic",
        batch_size=batch,
        epochs=100000,
        lease_seconds=30,
        optimizer_thread=optimizer_thread,
        backup_workers=backups,
    )
    with server_child(cfg) as (address, server):
        name = f"{policy}-{len(delays)}-{shm}-{backups}"
        children = worker_children(address, delays, shm, logs, name, device, local_steps)
        pids = [c.proc.pid for c in children]
        channel = connect(address, 60)
        stub = Stub(channel)
        try:
            _wait_until_training(stub, children, policy)
            time.sleep(warmup)
            t1, s1, cpu1 = _sample(stub, server.proc.pid, pids)
            time.sleep(window)
            t2, s2, cpu2 = _sample(stub, server.proc.pid, pids)
            while s2.samples == s1.samples and t2 - t1 < STALLED_WINDOW_S:  # a loaded host
                time.sleep(0.25)
                t2, s2, cpu2 = _sample(stub, server.proc.pid, pids)
        finally:
            channel.close()
            stop_all(children)
    if cpu is not None:
        cpu.update(
            server_s=cpu2[0] - cpu1[0],
            workers_s=cpu2[1] - cpu1[1],
            steps=(s2.samples - s1.samples) / batch,
        )
    before = {w.name: w.samples for w in s1.workers}
    after = sorted(s2.workers, key=lambda w: w.name)
    per_worker = [(w.samples - before.get(w.name, 0)) / (t2 - t1) for w in after]
    return (s2.samples - s1.samples) / (t2 - t1), per_worker


# Local steps in the benchmarks (issue 45): DiLoCo's outer step on the server, lr 0.7 and
# momentum 0.9 (under async and ssp:K its delayed form, Liu et al. 2024: Nesterov's momentum
# over stale pseudo-gradients diverged, see docs/architecture.md), AdamW's inner steps (lr
# 1e-3) on the workers.
def local_outer(policy: str, steps: int | None = None) -> OptimizerConfig:
    """The outer optimizer; with ``steps``, the run's outer steps, its rate decays by
    cosine over the run's batches (a constant rate ended 0.9 points under DDP's accuracy
    on Fashion-MNIST, the decay within 0.1)."""
    name = "nesterov" if Policy.parse(policy).synchronous else "delayed-nesterov"
    if steps is None:
        return OptimizerConfig(name, 0.7, momentum=0.9)
    return OptimizerConfig(
        name, 0.7, momentum=0.9, schedule="cosine", total_steps=steps, by="batches"
    )


LOCAL_INNER: dict[str, Any] = {"inner_optimizer": "adamw", "inner_lr": 1e-3, "overlap": "off"}


def worker_children(
    address: str,
    delays: list[float],
    shm: str,
    logs: Path,
    prefix: str,
    device: str = "cpu",
    local_steps: int = 0,
) -> list[Child]:
    """A worker process of ``address`` per entry of ``delays`` (its injected per-step sleep,
    ``shm`` its --shm, ``device`` its --device; ``local_steps`` H: H local AdamW steps a
    push), each logging to ``logs/PREFIX-worker-I.log``."""
    local: dict[str, Any] = {"push_every": local_steps, **LOCAL_INNER} if local_steps else {}
    return [
        Child(
            f"worker-{i}",
            worker_command(
                WorkerConfig(
                    address,
                    device=device,
                    threads=1,
                    name=f"w{i}",
                    step_delay=delay,
                    shm=shm,
                    **local,
                )
            ),
            logs / f"{prefix}-worker-{i}.log",
            env=CHILD_ENV,
        )
        for i, delay in enumerate(delays)
    ]


def report(name: str, rows: list[tuple[str, str]], figures: dict[str, Any], as_json: bool) -> None:
    """A readable table, or with ``--json`` one JSON line of the figures, with the date and
    the machine they were measured on (README quotes a line's figures only with them), and
    the commit of the tree measured where it is a git checkout."""
    if as_json:
        from paramserver.bench.report.results import commit, machine

        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        line = {"bench": name, **figures, "date": when, "machine": machine()}
        if (measured := commit()) is not None:
            line["commit"] = measured
        click.echo(json.dumps(line, sort_keys=True))
        return
    width = max(len(k) for k, _ in rows)
    click.echo(f"paramserver bench {name}")
    for key, value in rows:
        click.echo(f"  {key:<{width}}  {value}")
