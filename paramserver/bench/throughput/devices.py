"""``bench step`` and ``bench scaling`` with ``--device``: on CUDA, a worker's step and 1 and 2
workers' samples/s against a local step and one local process on the same GPU, for each
case of :func:`cases`. The CPU runs keep their own code (``step``, ``scaling``) and keys;
this module measures whatever device it is given, so the unit suite runs the CUDA cases'
code on the CPU (``tests/unit/test_bench_device.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from paramserver import models
from paramserver.bench.common import cluster_rate, median_seconds, server_child
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.errors import ConfigError
from paramserver.server.bookkeeping.store import build_optimizer
from paramserver.training.trainer import resolve_device
from paramserver.worker.worker import Worker

DEVICES = ("auto", "cpu", "cuda")
BIG = "mlp-20m"  # 20M parameters, 80 MB of float32: its bytes dominate its compute

# (model, batch) a CUDA run measures; a CPU run measures the MLP at 64 and 256 (``step``)
CASES = {
    "cuda": (("mlp", 64), ("mlp", 256), ("resnet", 256), (BIG, 1024)),
    "cpu": (("mlp", 64), ("mlp", 256)),
}
# issue 42's GPU targets: a worker's step <= x a local step, by (model, batch) ...
STEP_TARGETS = {(BIG, 1024): 2.5, ("mlp", 64): 1.5, ("resnet", 256): 1.3}
# ... and 2 workers on one GPU >= x one local process, by model
SCALING_TARGETS = {"mlp": 0.9, "resnet": 0.9, BIG: 0.4}
COUNTS = (1, 2)

Case = tuple[str, int]


def resolve(spec: str) -> torch.device:
    """``--device``: auto (CUDA when torch sees a GPU, else CPU), cpu or cuda.

    Raises:
        ConfigError: not one of those, or cuda where torch sees no GPU (one line).
    """
    if spec not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}; got {spec!r}.")
    return resolve_device(spec)


def cases(kind: str) -> tuple[Case, ...]:
    """The (model, batch) pairs a run on a device of ``kind`` ("cuda", "cpu") measures."""
    return CASES[kind]


def key(device: torch.device, model: str, batch: int) -> str:
    """``cuda_mlp_20m_1024``: the suffix of a case's figures (``step_vs_local_`` + key)."""
    return f"{device.type}_{model.replace('-', '_')}_{batch}"


def device_figures(device: torch.device) -> dict[str, Any]:
    """What a line of a device's run records of it: the device, the GPU's name, torch."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    return {"device": device.type, "gpu": gpu, "torch": torch.__version__}


def sync(device: torch.device) -> None:
    """Until the device has done what was queued on it (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch_on(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The bench's fixed batch of 28x28 images and labels (seeded by its size), on ``device``."""
    g = torch.Generator().manual_seed(batch)
    x, y = torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return x.to(device), y.to(device)


def local_step_seconds(model_name: str, batch: int, reps: int, device: torch.device) -> float:
    """A local training step of ``model_name`` on ``device`` (model, data and Adam there,
    fused where torch has it), until the device is done: the median of ``reps``."""
    model = models.build(model_name, seed=0).to(device)
    opt = build_optimizer(list(model.parameters()), OptimizerConfig("adam"))
    x, y = batch_on(batch, device)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sync(device)

    return median_seconds(step, reps, warmup=5)


def worker_step_seconds(
    address: str, model_name: str, batch: int, reps: int, device: torch.device
) -> float:
    """A worker's step of ``model_name`` on ``device`` (forward, backward, push and pull,
    with the worker's default overlap: on for CUDA, off on a CPU), until the device is done:
    the median of ``reps``."""
    model = models.build(model_name, seed=0).to(device)
    x, y = batch_on(batch, device)
    with Worker(address, model, device=device) as worker:

        def step() -> None:
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=batch)
            sync(device)

        return median_seconds(step, reps, warmup=5)


def _by_model(found: Sequence[Case]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for model, batch in found:
        out.setdefault(model, []).append(batch)
    return out


def measure_step(
    device: torch.device,
    found: Sequence[Case],
    reps: int,
    figures: dict[str, Any],
    rows: list[tuple[str, str]],
) -> None:
    """Each case's local step and worker step on ``device`` (one server child a model,
    ``async``, Adam), their ratio and, where the issue sets one, the target's verdict:
    into ``figures`` (``local_ms_K``, ``worker_ms_K``, ``step_vs_local_K``,
    ``target_step_vs_local_K``, K the case's :func:`key`) and ``rows``."""
    met = []
    for model, batches in _by_model(found).items():
        cfg = ServerConfig(
            model=model,
            optimizer=OptimizerConfig("adam"),
            policy="async",
            workers=1,
            lease_seconds=600,
        )
        with server_child(cfg) as (address, _):
            for batch in batches:
                k = key(device, model, batch)
                local = local_step_seconds(model, batch, reps, device)
                worker = worker_step_seconds(address, model, batch, reps, device)
                ratio = worker / local
                figures[f"local_ms_{k}"] = 1e3 * local
                figures[f"worker_ms_{k}"] = 1e3 * worker
                figures[f"step_vs_local_{k}"] = ratio
                verdict = ""
                if (target := STEP_TARGETS.get((model, batch))) is not None:
                    figures[f"target_step_vs_local_{k}"] = target
                    met.append(ratio <= target)
                    verdict = f"; target <= {target} x: {'met' if met[-1] else 'missed'}"
                rows.append(
                    (
                        f"{model}, batch {batch}",
                        f"local {1e3 * local:.2f} ms, worker {1e3 * worker:.2f} ms "
                        f"({ratio:.2f} x local){verdict}",
                    )
                )
    figures[f"target_met_{device.type}"] = all(met)


def measure_scaling(
    device: torch.device,
    found: Sequence[Case],
    timing: tuple[float, float],
    logs: Path,
    figures: dict[str, Any],
    rows: list[tuple[str, str]],
    reps: int = 50,
) -> None:
    """Each case's samples/s of 1 and 2 ``async`` worker processes on ``device`` (all on
    the one GPU), after ``timing``'s warmup over its window, against one local process
    there (``reps`` local steps): into ``figures`` (``local_samples_per_s_K``,
    ``async_samples_per_s_K``, ``async_vs_local_K``: a list by worker count, and
    ``target_2_workers_vs_local_K``, K the case's :func:`key`) and ``rows``."""
    warmup, window = timing
    met = []
    for model, batch in found:
        k = key(device, model, batch)
        local = batch / local_step_seconds(model, batch, reps, device)
        rates = [
            cluster_rate(
                "async",
                [0.0] * n,
                batch,
                warmup,
                window,
                logs,
                model=model,
                device=str(device),
            )[0]
            for n in COUNTS
        ]
        ratios = [r / local for r in rates]
        figures[f"local_samples_per_s_{k}"] = local
        figures[f"async_samples_per_s_{k}"] = rates
        figures[f"async_vs_local_{k}"] = ratios
        target = SCALING_TARGETS.get(model)
        verdict = ""
        if target is not None:
            figures[f"target_2_workers_vs_local_{k}"] = target
            met.append(ratios[COUNTS.index(2)] >= target)
            verdict = f"; 2 workers >= {target} x: {'met' if met[-1] else 'missed'}"
        rows.append(
            (
                f"{model}, batch {batch}",
                f"one local process {local:.0f} samples/s; async "
                + "  ".join(
                    f"{n} workers: {r:.0f} ({q:.2f} x local)"
                    for n, r, q in zip(COUNTS, rates, ratios, strict=True)
                )
                + verdict,
            )
        )
    figures[f"target_met_{device.type}"] = all(met)
