"""2 workers, one slowed 3x by an injected per-step delay: a parameter server under async and
delay-1 against PyTorch DDP (gloo on CPU, nccl on GPU) with the same model, batch and delay."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from paramserver.bench.common import cluster_rate
from paramserver.bench.ddp import run_ranks
from paramserver.bench.step import local_step_seconds

BATCH = 64


def ddp_rate(delay: float, steps: int, logs: Path) -> float:
    """Total samples/s of 2 DDP processes, the last rank with the delay."""
    args = [str(steps), str(BATCH), repr(delay)]
    results = run_ranks("paramserver.bench.ddp", args, 2, logs, "ddp", timeout=600)
    return sum(r["samples"] for r in results) / max(r["seconds"] for r in results)


def run(quick: bool) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    torch.set_num_threads(1)
    compute = local_step_seconds(BATCH, 50)
    # The slow worker's step takes 3x: compute + 2 x compute of sleep. Floors keep the delay
    # meaningful against the per-step communication on a loaded 2-core machine.
    delay = max(2 * compute, 0.01)
    warmup, window = (0.5, 1.5) if quick else (3.0, 15.0)
    figures: dict[str, Any] = {
        "batch": BATCH,
        "delay_s": delay,
        "window_s": window,
        "local_step_ms": 1000 * compute,
    }
    rows = [
        (
            "setup",
            f"mlp, batch {BATCH}, 2 workers, worker 1 sleeps {1000 * delay:.1f} ms a step "
            f"(local step {1000 * compute:.1f} ms); {window:.0f} s window",
        )
    ]
    with tempfile.TemporaryDirectory(prefix="paramserver-bench-") as tmp:
        logs = Path(tmp)
        ddp_steps = max(10, int((warmup + window) / (compute + delay)))
        figures["ddp_samples_per_s"] = ddp = ddp_rate(delay, ddp_steps, logs)
        rows.append(("DDP (gloo)", f"{ddp:.0f} samples/s"))
        figures["ps_vs_ddp"] = {}
        for policy in ("async", "delay-1"):
            total, per_worker = cluster_rate(policy, [0.0, delay], BATCH, warmup, window, logs)
            key = policy.replace("-", "")
            figures[f"{key}_samples_per_s"] = total
            figures[f"{key}_per_worker"] = per_worker
            figures["ps_vs_ddp"][policy] = total / ddp
            rows.append(
                (
                    f"paramserver {policy}",
                    f"{total:.0f} samples/s (fast {per_worker[0]:.0f}, "
                    f"slow {per_worker[-1]:.0f}): {total / ddp:.2f} x DDP",
                )
            )
    figures["target_ps_vs_ddp"] = 1.5
    rows.append(("target", ">= 1.5 x DDP"))
    return rows, figures
