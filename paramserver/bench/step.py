"""One worker's step (compute, push, pull) against a local training step of the same model."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from paramserver import models
from paramserver.bench.common import median_seconds, server_process
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.store import build_optimizer
from paramserver.worker.worker import Worker


def _batch(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch)
    return torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)


def local_step_seconds(batch: int, reps: int) -> float:
    model = models.build("mlp", seed=0)
    opt = build_optimizer(list(model.parameters()), OptimizerConfig("adam"))
    x, y = _batch(batch)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return median_seconds(step, reps, warmup=5)


def worker_step_seconds(address: str, batch: int, reps: int, overlap: bool = False) -> float:
    model = models.build("mlp", seed=0)
    x, y = _batch(batch)
    with Worker(address, model, overlap=overlap) as worker:

        def step() -> None:
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=batch)

        return median_seconds(step, reps, warmup=5)


def run(quick: bool) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    torch.set_num_threads(1)
    reps = 20 if quick else 200
    figures: dict[str, Any] = {"threads": 1, "reps": reps, "model": "mlp", "optimizer": "adam"}
    rows = [("model", f"mlp, Adam, 1 torch thread, median of {reps} steps")]
    cfg = ServerConfig(model="mlp", optimizer=OptimizerConfig("adam"), policy="async",
                       workers=1, lease_seconds=600)  # fmt: skip
    with server_process(cfg) as address:
        for batch in (64, 256):
            local = local_step_seconds(batch, reps)
            # overlap off (the CPU default): push, then pull, in one round trip; overlap on:
            # that round trip runs while the next batch computes (prefetch).
            waiting = worker_step_seconds(address, batch, reps, overlap=False)
            ahead = worker_step_seconds(address, batch, reps, overlap=True)
            best = min(waiting, ahead)
            figures[f"local_ms_{batch}"] = 1000 * local
            figures[f"worker_ms_{batch}"] = 1000 * waiting
            figures[f"worker_overlap_ms_{batch}"] = 1000 * ahead
            figures[f"step_vs_local_no_overlap_{batch}"] = waiting / local
            figures[f"step_vs_local_overlap_{batch}"] = ahead / local
            figures[f"step_vs_local_{batch}"] = best / local
            rows.append((f"batch {batch}", f"local {1000 * local:.2f} ms; worker {1000 * waiting:.2f} ms "
                                           f"({waiting / local:.2f} x local), with --overlap on "
                                           f"{1000 * ahead:.2f} ms ({ahead / local:.2f} x local)"))  # fmt: skip
    figures["step_vs_local"] = {
        "64": figures["step_vs_local_64"],
        "256": figures["step_vs_local_256"],
    }
    figures["target_step_vs_local_256"] = 1.25
    figures["target_met"] = figures["step_vs_local_256"] <= 1.25
    rows.append(
        (
            "target",
            "<= 1.25 x local at batch 256: " + ("met" if figures["target_met"] else "missed"),
        )
    )
    return rows, figures
