"""One worker's step (compute, push, pull) against a local training step of the same model;
with ``--device cuda``, on the GPU for each of ``devices.cases("cuda")`` (``devices``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from paramserver import models
from paramserver.bench.common import cpu_seconds, median_seconds, server_child
from paramserver.bench.throughput import devices
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.server.bookkeeping.store import build_optimizer
from paramserver.worker.worker import Worker


def _batch(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch)
    return torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)


def local_step_seconds(batch: int, reps: int, optimizer: bool = True) -> float:
    """A local training step of the MLP (Adam); without ``optimizer``, its forward and
    backward passes alone: the compute a worker does (the optimizer's step is the
    server's)."""
    model = models.build("mlp", seed=0)
    opt = build_optimizer(list(model.parameters()), OptimizerConfig("adam"))
    x, y = _batch(batch)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if optimizer:
            opt.step()

    return median_seconds(step, reps, warmup=5)


def worker_step_seconds(
    address: str, batch: int, reps: int, overlap: bool = False, control: bool = True
) -> float:
    model = models.build("mlp", seed=0)
    x, y = _batch(batch)
    with Worker(address, model, overlap=overlap, shm_control=control) as worker:
        if worker.control_active is not control:
            raise RuntimeError(
                f"the worker {'could not' if control else 'did'} use the server's control socket"
            )

        def step() -> None:
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=batch)

        return median_seconds(step, reps, warmup=5)


# the step's control: the same-host socket (the default), or a gRPC call (--shm payloads);
# the payloads go through the shared segment either way
PATHS = {"socket": True, "grpc": False}
TARGETS = {64: 1.3, 256: 1.25}  # x a local step, with default settings (overlap off on CPU)


def run(quick: bool, device: str = "auto") -> tuple[list[tuple[str, str]], dict[str, Any]]:
    found = devices.resolve(device)
    if found.type != "cpu":
        return run_on(found, devices.cases(found.type), 20 if quick else 200)
    torch.set_num_threads(1)
    reps = 20 if quick else 400
    figures: dict[str, Any] = {"threads": 1, "reps": reps, "model": "mlp", "optimizer": "adam"}
    rows = [
        (
            "model",
            f"mlp, Adam, 1 torch thread, median of {reps} steps; payloads in shared "
            "memory, control over the same-host socket or gRPC",
        )
    ]
    cfg = ServerConfig(
        model="mlp", optimizer=OptimizerConfig("adam"), policy="async", workers=1, lease_seconds=600
    )
    with server_child(cfg) as (address, server):
        for batch in (64, 256):
            local = local_step_seconds(batch, reps)
            figures[f"local_ms_{batch}"] = 1000 * local
            rows.append((f"batch {batch}", f"local {1000 * local:.2f} ms"))
            path_figures(address, server.proc.pid, batch, reps, local, figures, rows)
    figures["step_vs_local"] = {str(b): figures[f"step_vs_local_{b}"] for b in (64, 256)}
    figures["targets"] = {str(b): t for b, t in TARGETS.items()}
    for b, t in TARGETS.items():
        figures[f"target_step_vs_local_{b}"] = t
    met = {b: figures[f"step_vs_local_{b}"] <= t for b, t in TARGETS.items()}
    figures["target_met"] = all(met.values())
    rows.append(
        (
            "targets",
            "; ".join(
                f"<= {t} x local at batch {b} (default settings): {'met' if met[b] else 'missed'}"
                for b, t in TARGETS.items()
            ),
        )
    )
    return rows, figures


def path_figures(
    address: str,
    pid: int,
    batch: int,
    reps: int,
    local: float,
    figures: dict[str, Any],
    rows: list[tuple[str, str]],
) -> None:
    """A worker's step at ``batch`` over each control path (``PATHS``), overlap off and on,
    and the CPU of the server (process ``pid``) per blocking step, each against the local
    step's ``local`` seconds: into ``figures`` and ``rows``."""
    for path, control in PATHS.items():
        # overlap off (the CPU default): push, then pull, in one round trip; overlap
        # on: that round trip runs while the next batch computes (prefetch).
        cpu = cpu_seconds(pid)
        waiting = worker_step_seconds(address, batch, reps, False, control)
        # the server's CPU per blocking step (clock ticks: about 10% resolution)
        server_ms = 1000 * (cpu_seconds(pid) - cpu) / (reps + 5)
        ahead = worker_step_seconds(address, batch, reps, True, control)
        suffix = "" if control else "_grpc"
        figures[f"server_cpu_ms_{batch}{suffix}"] = server_ms
        figures[f"worker_ms_{batch}{suffix}"] = 1000 * waiting
        figures[f"worker_overlap_ms_{batch}{suffix}"] = 1000 * ahead
        figures[f"step_vs_local_{batch}{suffix}"] = waiting / local
        figures[f"step_vs_local_overlap_{batch}{suffix}"] = ahead / local
        rows.append(
            (
                f"  {path} control",
                f"worker {1000 * waiting:.2f} ms "
                f"({waiting / local:.2f} x local; server CPU "
                f"{server_ms:.2f} ms), with --overlap "
                f"on {1000 * ahead:.2f} ms ({ahead / local:.2f} x local)",
            )
        )


def run_on(
    device: torch.device, found: tuple[devices.Case, ...], reps: int
) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """The step of each case of ``found`` on ``device`` against a local step there
    (``devices.measure_step``), with the device's name and torch's version."""
    torch.set_num_threads(1)
    figures: dict[str, Any] = {**devices.device_figures(device), "threads": 1, "reps": reps}
    figures["optimizer"] = "adam"
    rows = [
        (
            "device",
            f"{device.type} ({figures['gpu']}), torch {figures['torch']}, Adam, median of "
            f"{reps} steps, each until the device is done; the worker's default overlap",
        )
    ]
    devices.measure_step(device, found, reps, figures, rows)
    return rows, figures
