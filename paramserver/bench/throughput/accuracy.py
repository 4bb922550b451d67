"""Wall time to a test accuracy (88% on Fashion-MNIST) per policy, 2 workers, against one
local process and against 2 DDP processes, all with the MLP, batch 64 per process, Adam 1e-3
with a cosine decay over the whole run (what ``launch`` does by default; with a constant
rate this MLP hovers at 87-88%) and one torch thread per process, evaluated after every
epoch.

The DDP side runs as ``python -m paramserver.bench.throughput.accuracy RANK WORLD PORT EPOCHS DATASET
OUT``: each rank trains on every other batch of the same seeded epoch permutation, and rank 0
evaluates after each epoch (outside the timed part) and writes the curve to OUT.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from paramserver import models
from paramserver.bench.ddp import run_ranks
from paramserver.cluster import procs
from paramserver.cluster.launch import launch_args, planned_optimizer_steps
from paramserver.config import LaunchConfig, OptimizerConfig, ServerConfig
from paramserver.server.bookkeeping.store import build_optimizer
from paramserver.training import data
from paramserver.training.evaluation import evaluate

BATCH = 64
POLICIES = ("sync", "delay-1", "async")


def _schedule(epochs: int, steps_per_epoch: int) -> OptimizerConfig:
    return OptimizerConfig("adam", lr=1e-3, schedule="cosine", total_steps=epochs * steps_per_epoch)


def _epoch(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    cfg: OptimizerConfig,
    ds: data.Dataset,
    epoch: int,
    rank: int = 0,
    world: int = 1,
) -> None:
    order = data.epoch_permutation(len(ds.train_x), epoch, seed=0)
    # Every rank takes the same number of batches: DDP's collectives must pair up.
    usable = data.batches_per_epoch(len(order), BATCH) // world * world
    for i, b in enumerate(range(rank, usable, world)):
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(epoch * (usable // world) + i)
        idx = order[b * BATCH : (b + 1) * BATCH]
        opt.zero_grad()
        F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx]).backward()
        opt.step()


def local_curve(dataset: str, epochs: int) -> list[tuple[float, float]]:
    """(training seconds, test accuracy) after each epoch of one local process."""
    torch.set_num_threads(1)
    # The first step's grad-mode wrapper imports torch._dynamo (1-2 s of CPU): here, before
    # the clock, as when the optimizer's constructor imported it (``config/lazy_dynamo.py``).
    importlib.import_module("torch._dynamo")
    ds = data.load_builtin(dataset)
    model = models.build("mlp", seed=0)
    cfg = _schedule(epochs, data.batches_per_epoch(len(ds.train_x), BATCH))
    opt = build_optimizer(list(model.parameters()), cfg)
    curve, seconds = [], 0.0
    for epoch in range(epochs):
        started = time.perf_counter()
        _epoch(model, opt, cfg, ds, epoch)
        seconds += time.perf_counter() - started
        curve.append((seconds, evaluate(model, ds.test_x, ds.test_y).accuracy))
    return curve


def ddp_main(argv: list[str]) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from paramserver.bench.ddp import finish, master, write_result

    rank, world, port, epochs = (int(a) for a in argv[:4])
    dataset, out = argv[4], argv[5]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master()}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=5),
    )
    ds = data.load_builtin(dataset)
    model = DistributedDataParallel(models.build("mlp", seed=0))
    cfg = _schedule(epochs, data.batches_per_epoch(len(ds.train_x), BATCH) // world)
    opt = build_optimizer(list(model.parameters()), cfg)
    curve, seconds = [], 0.0
    for epoch in range(epochs):
        dist.barrier()
        started = time.perf_counter()
        _epoch(model, opt, cfg, ds, epoch, rank, world)
        dist.barrier()
        seconds += time.perf_counter() - started
        if rank == 0:
            curve.append((seconds, evaluate(model.module, ds.test_x, ds.test_y).accuracy))
    write_result(out, curve)  # rank 0's curve; the others write []
    finish()


def ddp_curve(dataset: str, epochs: int, logs: Path) -> list[tuple[float, float]]:
    results = run_ranks(
        "paramserver.bench.throughput.accuracy",
        [str(epochs), dataset],
        2,
        logs,
        "ddp-acc",
        timeout=900,
    )
    return [tuple(point) for point in results[0]]


def ps_curve(policy: str, dataset: str, epochs: int, logs: Path) -> list[tuple[float, float]]:
    """(seconds, test accuracy) after each epoch of ``paramserver launch`` with 2 workers.

    Seconds are the server's training time (first applied push to the last before the
    evaluation), like the local and DDP figures: starting the processes is not counted.
    """
    run_dir = logs / f"run-{policy}"
    server = ServerConfig(
        model="mlp", policy=policy, workers=2, dataset=dataset, epochs=epochs, batch_size=BATCH
    )
    steps = planned_optimizer_steps(server, data.train_size(dataset))  # what launch works out
    optimizer = OptimizerConfig("adam", 1e-3, schedule="cosine", total_steps=steps)
    cfg = LaunchConfig(
        server=dataclasses.replace(server, optimizer=optimizer), run_dir=str(run_dir)
    )
    cmd = [sys.executable, "-m", "paramserver", *launch_args(cfg), "--no-progress", "--json"]
    with open(logs / f"launch-{policy}.log", "wb") as err:
        done = procs.run(cmd, 900, capture=False, stdout=subprocess.DEVNULL, stderr=err)
    if done.returncode != 0:
        tail = (logs / f"launch-{policy}.log").read_text()[-800:]
        raise RuntimeError(f"launch under {policy} failed: {tail}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["train_s"], r["test_accuracy"]) for r in map(json.loads, lines)]


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """Seconds at the first evaluation at or above ``target``; None if never."""
    return next((s for s, acc in curve if acc >= target), None)


def run(quick: bool) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    dataset, target, epochs = ("synthetic", 0.6, 2) if quick else ("fashion-mnist", 0.88, 10)
    figures: dict[str, Any] = {
        "dataset": dataset,
        "target_accuracy": target,
        "epochs": epochs,
        "batch": BATCH,
        "curves": {},
        "time_to_target_s": {},
    }
    with tempfile.TemporaryDirectory(prefix="paramserver-bench-") as tmp:
        logs = Path(tmp)
        curves = {"local": local_curve(dataset, epochs), "ddp": ddp_curve(dataset, epochs, logs)}
        for policy in POLICIES:
            curves[policy] = ps_curve(policy, dataset, epochs, logs)
    rows = [
        (
            "setup",
            f"mlp, batch {BATCH} per process, Adam 1e-3 cosine, {dataset}, target "
            f"{100 * target:.0f}% test accuracy, evaluated after each of {epochs} epochs",
        )
    ]
    for name, curve in curves.items():
        figures["curves"][name] = curve
        seconds = figures["time_to_target_s"][name] = time_to(curve, target)
        label = {"local": "one local process", "ddp": "DDP, 2 processes (gloo)"}.get(
            name, f"paramserver {name}, 2 workers"
        )
        best = max(acc for _, acc in curve)
        rows.append(
            (
                label,
                (f"{seconds:.1f} s" if seconds is not None else "not reached")
                + f"  (best {100 * best:.2f}% in {curve[-1][0]:.1f} s)",
            )
        )
    rows.append(("note", "training time only: process start-up and evaluation are not counted"))
    return rows, figures


if __name__ == "__main__":
    ddp_main(sys.argv[1:])
