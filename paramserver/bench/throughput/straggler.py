"""2 workers, one slowed 3x by an injected per-step delay: a parameter server under async and
delay-1 against PyTorch DDP (gloo on CPU, nccl on GPU) with the same model, batch and delay.
Then 3 workers, one slowed 3x: sync with a backup worker (``--backup-workers 1``: each
round closes on the 2 fastest pushes) and plain sync, against DDP with 3 ranks, one slowed
the same (``sync_backup_samples_vs_ddp``); and the test accuracy of whole runs of both
after the same epochs (``sync_backup_accuracy_gap_points``: plain sync's minus the
backup's). Then local steps (issue 45: 8 local AdamW steps a push; the server's outer step
Nesterov's under sync, Delayed Nesterov under async), 2 workers, one slowed 3x: async against sync (``local_async_vs_sync``), and the
test accuracy of whole runs of both (``local_async_accuracy_gap_points``)."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import torch

from paramserver import models
from paramserver._proto import paramserver_pb2 as pb
from paramserver.bench.common import cluster_rate, local_outer, server_process, worker_children
from paramserver.bench.ddp import run_ranks
from paramserver.bench.throughput.step import local_step_seconds
from paramserver.cluster.launch import planned_optimizer_steps
from paramserver.cluster.procs import stop_all
from paramserver.codec.layout import Manifest, unflatten_into
from paramserver.config import ServerConfig
from paramserver.training import data
from paramserver.training.evaluation import evaluate
from paramserver.transport.channels import observe
from paramserver.transport.stub import Stub, connect

BATCH = 64


def ddp_rate(delay: float, steps: int, logs: Path, world: int = 2) -> float:
    """Total samples/s of ``world`` DDP processes, the last rank with the delay."""
    args = [str(steps), str(BATCH), repr(delay)]
    results = run_ranks("paramserver.bench.ddp", args, world, logs, f"ddp{world}", timeout=600)
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
        rows += _backups(figures, delay, ddp_steps, warmup, window, logs)
        rows += _accuracies(figures, delay, quick, logs)
        rows += _local_steps(figures, delay, warmup, window, quick, logs)
    figures["target_ps_vs_ddp"] = 1.5
    rows.append(("target", ">= 1.5 x DDP"))
    return rows, figures


LOCAL_H = 8  # inner steps a push in the local-steps runs


def _local_steps(
    figures: dict[str, Any], delay: float, warmup: float, window: float, quick: bool, logs: Path
) -> list[tuple[str, str]]:
    """Local steps (issue 45), 2 workers, the second slowed: async against sync, their
    samples/s and the test accuracy of whole runs after the same epochs."""
    rows = []
    dataset, epochs = ("synthetic", 1) if quick else ("fashion-mnist", 3)
    # --step-delay sleeps once a push: H batches' worth keeps the slow worker 3x slower
    delays = [0.0, delay * LOCAL_H]
    for policy in ("sync", "async"):
        total, per_worker = cluster_rate(
            policy, delays, BATCH, warmup, window, logs, local_steps=LOCAL_H
        )
        acc, seconds = accuracy_after(
            0, delay, dataset, epochs, logs, policy=policy, delays=delays, local=LOCAL_H
        )
        figures[f"local_{policy}_samples_per_s"] = total
        figures[f"local_{policy}_per_worker"] = per_worker
        figures[f"local_{policy}_accuracy"], figures[f"local_{policy}_train_s"] = acc, seconds
        rows.append(
            (
                f"local steps (H {LOCAL_H}), {policy}",
                f"{total:.0f} samples/s (fast {per_worker[0]:.0f}, slow {per_worker[-1]:.0f}); "
                f"{100 * acc:.2f}% after {epochs} epochs of {dataset} in {seconds:.1f} s",
            )
        )
    ratio = figures["local_async_samples_per_s"] / figures["local_sync_samples_per_s"]
    gap = 100 * (figures["local_async_accuracy"] - figures["local_sync_accuracy"])
    figures["local_async_vs_sync"], figures["local_async_accuracy_gap_points"] = ratio, gap
    figures["target_local_async_vs_sync"] = 1.5
    rows.append(
        ("local async / sync", f"{ratio:.2f} x (target >= 1.5), accuracy {gap:+.2f} points")
    )
    return rows


def _backups(
    figures: dict[str, Any], delay: float, steps: int, warmup: float, window: float, logs: Path
) -> list[tuple[str, str]]:
    """3 workers, the last slowed: sync with one backup worker and plain sync, against 3
    DDP ranks, the last slowed."""
    figures["ddp3_samples_per_s"] = ddp = ddp_rate(delay, steps, logs, world=3)
    rows = [("DDP (gloo), 3 ranks, 1 slowed", f"{ddp:.0f} samples/s")]
    delays = [0.0, 0.0, delay]
    for key, backups in (("sync_backup", 1), ("sync3", 0)):
        total, per_worker = cluster_rate(
            "sync", delays, BATCH, warmup, window, logs, "on", False, backups
        )
        figures[f"{key}_samples_per_s"] = total
        figures[f"{key}_per_worker"] = per_worker
        figures[f"{key}_samples_vs_ddp"] = total / ddp
        label = "sync, 3 workers, --backup-workers 1" if backups else "sync, 3 workers"
        rows.append(
            (
                f"paramserver {label}",
                f"{total:.0f} samples/s (slow worker's applied: {per_worker[-1]:.0f}): "
                f"{total / ddp:.2f} x DDP",
            )
        )
    return rows


def _accuracies(
    figures: dict[str, Any], delay: float, quick: bool, logs: Path
) -> list[tuple[str, str]]:
    """Whole sync runs with and without a backup worker: their test accuracy."""
    dataset, epochs = ("synthetic", 1) if quick else ("fashion-mnist", 3)
    for key, backups in (("sync_backup", 1), ("sync3", 0)):
        acc, seconds = accuracy_after(backups, delay, dataset, epochs, logs)
        figures[f"{key}_accuracy"], figures[f"{key}_train_s"] = acc, seconds
    gap = 100 * (figures["sync3_accuracy"] - figures["sync_backup_accuracy"])
    figures["sync_backup_accuracy_gap_points"] = gap
    text = (
        f"sync with a backup {100 * figures['sync_backup_accuracy']:.2f}% in "
        f"{figures['sync_backup_train_s']:.1f} s, plain sync "
        f"{100 * figures['sync3_accuracy']:.2f}% in {figures['sync3_train_s']:.1f} s "
        f"({gap:+.2f} points)"
    )
    return [(f"test accuracy after {epochs} epochs of {dataset}", text)]


def accuracy_after(
    backups: int,
    delay: float,
    dataset: str,
    epochs: int,
    logs: Path,
    policy: str = "sync",
    delays: list[float] | None = None,
    local: int = 0,
) -> tuple[float, float]:
    """Test accuracy of a whole run (``policy``; 3 workers, the last slowed by ``delay``, or
    one a delay of ``delays``; Adam 1e-3, or with ``local`` H local steps a push under the
    server's ``local_outer``, decaying over the run) with ``backups`` backup workers, and
    its training seconds."""
    delays = [0.0, 0.0, delay] if delays is None else delays
    cfg = ServerConfig(
        model="mlp",
        policy=policy,
        workers=len(delays),
        dataset=dataset,
        batch_size=BATCH,
        epochs=epochs,
        lease_seconds=30,
        backup_workers=backups,
    )
    if local:  # the outer rate decays over the run's outer steps, as launch's does
        steps = planned_optimizer_steps(cfg, data.train_size(dataset), push_every=local)
        cfg = dataclasses.replace(cfg, optimizer=local_outer(policy, steps))
    model = models.build("mlp", seed=0)
    tensors = [p.data for p in model.parameters()]
    manifest = Manifest.from_tensors([(n, p) for n, p in model.named_parameters()])
    with server_process(cfg) as address:
        name = f"acc-{policy}-{backups}-{local}"
        children = worker_children(address, delays, "on", logs, name, local_steps=local)
        try:
            for child in children:
                if child.proc.wait(timeout=1800) != 0:
                    raise RuntimeError(f"{child.name} failed: {child.tail()}")
            channel = connect(address, 60)
            try:
                seconds = Stub(channel).Status(pb.StatusRequest(), timeout=30).train_seconds
                _, flat = observe(channel, manifest.total_bytes)
            finally:
                channel.close()
        finally:
            stop_all(children)
    unflatten_into(manifest, torch.from_numpy(flat), tensors)
    ds = data.load_builtin(dataset)
    return evaluate(model, ds.test_x, ds.test_y).accuracy, seconds
