"""Samples/s of 1, 2 and 4 workers under each policy, against one local process (one torch
thread, like each worker), and, for honesty, one local process with a thread per core.
Workers step over the same-host control socket (the default) and, side by side, over gRPC
calls (``--shm payloads``); the payloads go through shared memory either way (``--quick``:
2 workers, gRPC calls under async only). With
``--device cuda``: 1 and 2 ``async`` workers sharing the GPU against one local process on
it, for each of ``devices.cases("cuda")`` (``devices``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from paramserver.bench.common import cluster_rate
from paramserver.bench.throughput import devices
from paramserver.bench.throughput.step import local_step_seconds

BATCH = 64
POLICIES = ("sync", "delay-1", "async")


def run(quick: bool, device: str = "auto") -> tuple[list[tuple[str, str]], dict[str, Any]]:
    found = devices.resolve(device)
    if found.type != "cpu":
        timing = (0.5, 1.0) if quick else (2.0, 8.0)
        return run_on(found, devices.cases(found.type), timing, 20 if quick else 100)
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    local_all = BATCH / local_step_seconds(BATCH, 50 if quick else 300)
    torch.set_num_threads(1)
    local = BATCH / local_step_seconds(BATCH, 50 if quick else 300)
    compute_s = local_step_seconds(BATCH, 50 if quick else 300, optimizer=False)
    # quick: each path once (every policy over the socket, gRPC control under async), at 2
    # workers, the count the verdict reads: each run starts processes that import torch
    counts = (2,) if quick else (1, 2, 4)
    grpc = ("async",) if quick else POLICIES
    warmup, window = (0.5, 1.0) if quick else (2.0, 8.0)
    figures: dict[str, Any] = {
        "batch": BATCH,
        "local_samples_per_s": local,
        "workers": list(counts),
        "window_s": window,
        "cores": cores,
        "local_all_cores_samples_per_s": local_all,
        "local_compute_ms": 1e3 * compute_s,
    }
    rows = [
        ("one local process", f"{local:.0f} samples/s (mlp, batch {BATCH}, Adam, 1 thread)"),
        (f"... with {cores} threads", f"{local_all:.0f} samples/s"),
    ]
    with tempfile.TemporaryDirectory(prefix="paramserver-bench-") as tmp:
        policy_rates(
            counts, (warmup, window), Path(tmp), (local, local_all, compute_s), figures, rows, grpc
        )
        # the server's optimizer on its own thread (--optimizer-thread), 2 workers
        rate = cluster_rate(
            "async", [0.0, 0.0], BATCH, warmup, window, Path(tmp), optimizer_thread=True
        )[0]
        figures["async_optimizer_thread_samples_per_s"] = rate
        figures["async_optimizer_thread_vs_local"] = rate / local
        rows.append(
            ("async, --optimizer-thread", f"2 workers: {rate:.0f} ({rate / local:.2f} x local)")
        )
    _verdict(figures, rows, counts.index(2))
    return rows, figures


def _verdict(figures: dict[str, Any], rows: list[tuple[str, str]], two: int) -> None:
    """The fastest policy's CPU a step and the targets' verdicts, at 2 workers (``two``:
    their place in the counts), into ``figures`` and ``rows``."""
    best = max(figures[f"{p.replace('-', '')}_vs_local"][two] for p in POLICIES)
    fastest = max(POLICIES, key=lambda p: figures[f"{p.replace('-', '')}_vs_local"][two])
    split = figures[f"{fastest.replace('-', '')}_cpu_ms_per_step"]
    figures["cpu_ms_per_step"] = split
    figures["cpu_ms_per_step_policy"] = fastest
    rows.append(
        (
            f"CPU a step, 2 workers, {fastest}",
            f"worker compute {split['worker_compute']:.2f} ms, worker overhead "
            f"{split['worker_overhead']:.2f} ms, server {split['server']:.2f} ms",
        )
    )
    best_all = max(figures[f"{p.replace('-', '')}_vs_local_all_cores"][two] for p in POLICIES)
    figures["target_2_workers_vs_local"] = 1.3
    figures["target_2_workers_vs_local_all_cores"] = 1.0
    figures["target_met"] = best >= 1.3 and best_all >= 1.0
    for what, got, target in (
        ("one local process, 1 thread", best, 1.3),
        ("one local process, a thread per core", best_all, 1.0),
    ):
        verdict = "met" if got >= target else "missed"
        rows.append(("target", f"2 workers >= {target} x {what}: best {got:.2f} x, {verdict}"))


def cpu_split(cpu: dict[str, float], compute_s: float) -> dict[str, float]:
    """CPU milliseconds a step of a cluster's run (``cluster_rate``'s ``cpu``) costs: the
    worker's compute (``compute_s``: a local one-thread forward and backward pass, which is
    its CPU; the optimizer's step is the server's), the worker's overhead around it (the
    rest of the workers' CPU) and the server's."""
    steps = max(cpu["steps"], 1.0)
    worker = 1e3 * cpu["workers_s"] / steps
    compute = 1e3 * compute_s
    return {
        "worker_compute": compute,
        "worker_overhead": worker - compute,
        "server": 1e3 * cpu["server_s"] / steps,
    }


def policy_rates(
    counts: tuple[int, ...],
    timing: tuple[float, float],
    logs: Path,
    locals_: tuple[float, float, float],
    figures: dict[str, Any],
    rows: list[tuple[str, str]],
    grpc: tuple[str, ...] = POLICIES,
) -> None:
    """Samples/s of ``counts`` workers under each policy, over the control socket and (the
    policies of ``grpc``) over gRPC calls, measured after ``timing``'s warmup over its window, and each against the
    local rates (1 thread, a thread per core; then a local forward and backward's seconds,
    for the CPU split): into ``figures`` and ``rows``."""
    warmup, window = timing
    local, local_all, compute_s = locals_
    for policy in POLICIES:
        channels = (("on", ""), ("payloads", "_grpc")) if policy in grpc else (("on", ""),)
        for shm, suffix in channels:
            key = policy.replace("-", "") + suffix
            rates = []
            for n in counts:
                cpu: dict[str, float] = {}
                rates.append(
                    cluster_rate(policy, [0.0] * n, BATCH, warmup, window, logs, shm, cpu=cpu)[0]
                )
                if n == 2:
                    figures[f"{key}_cpu_ms_per_step"] = cpu_split(cpu, compute_s)
            figures[f"{key}_samples_per_s"] = rates
            figures[f"{key}_vs_local"] = [r / local for r in rates]
            figures[f"{key}_vs_local_all_cores"] = [r / local_all for r in rates]
            rows.append(
                (
                    f"{policy}{', gRPC control' if suffix else ''}",
                    "  ".join(
                        f"{n} workers: {r:.0f} ({r / local:.2f} x local)"
                        for n, r in zip(counts, rates, strict=True)
                    ),
                )
            )


def run_on(
    device: torch.device, found: tuple[devices.Case, ...], timing: tuple[float, float], reps: int
) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Samples/s of 1 and 2 workers on ``device`` against one local process there, for each
    case of ``found`` (``devices.measure_scaling``), with the device's name and torch's
    version."""
    torch.set_num_threads(1)
    figures: dict[str, Any] = {**devices.device_figures(device), "workers": list(devices.COUNTS)}
    figures["window_s"] = timing[1]
    rows = [
        (
            "device",
            f"{device.type} ({figures['gpu']}), torch {figures['torch']}, Adam, async, "
            "one torch thread a process, every process on the one device",
        )
    ]
    with tempfile.TemporaryDirectory(prefix="paramserver-bench-") as tmp:
        devices.measure_scaling(device, found, timing, Path(tmp), figures, rows, reps)
    return rows, figures
