"""The worker daemon's training loop: shard, forward, backward, step."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from paramserver._proto import paramserver_pb2 as pb
from paramserver.config import WorkerConfig
from paramserver.errors import ConfigError
from paramserver.training import data
from paramserver.worker.worker import Worker

log = logging.getLogger(__name__)


def resolve_device(spec: str) -> torch.device:
    """``auto`` is CUDA when present, else CPU; an explicit CUDA device must exist.

    Raises:
        ConfigError: CUDA was asked for and is not there.
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {spec} asks for CUDA, but this torch build sees no GPU "
                f"(torch {torch.__version__}); use --device cpu or auto."
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {spec} does not exist: this machine has "
                f"{torch.cuda.device_count()} GPU(s)."
            )
    return device


def process_devices(spec: str, procs: int, gpus: int) -> list[str]:
    """The --device of each of ``procs`` worker processes on a host with ``gpus`` GPUs.

    ``auto`` and ``cuda`` spread the processes over the GPUs round-robin (one per GPU when
    there are as many); ``auto`` without GPUs and any explicit device are used as given.
    """
    if spec in ("auto", "cuda") and gpus > 0:
        return [f"cuda:{i % gpus}" for i in range(procs)]
    return [spec] * procs


@dataclass(frozen=True)
class WorkerSummary:
    rank: int
    steps: int
    samples: int
    seconds: float
    rejoins: int = 0
    row_cache_hits: int = 0  # sparse tables: distinct ids found in the row caches
    row_cache_misses: int = 0  # and fetched on demand


def worker_arguments(cfg: WorkerConfig, device: torch.device) -> dict[str, Any]:
    """The Worker's keyword arguments that ``cfg`` gives: each of its fields that Worker
    takes under the same name, as it is, and those Worker takes in another form."""
    takes = inspect.signature(Worker).parameters
    same = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in takes}
    return {**same, "device": device, "connect_timeout": cfg.rpc_timeout,
            "overlap": cfg.overlap_flag, "shm": cfg.shm != "off", "shm_control": cfg.shm == "on"}  # fmt: skip


def run(cfg: WorkerConfig) -> WorkerSummary:
    """Join the server and train on the batches it hands out until the run is finished."""
    torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    loaded: dict[str, data.Data] = {}

    def load(plan: pb.TrainingPlan) -> int:
        loaded["data"] = data.load(plan.dataset, cfg.data_dir, seed=plan.seed)
        return loaded["data"].train_size

    worker = Worker(cfg.addresses, **worker_arguments(cfg, device), train_samples=load)
    started = time.perf_counter()
    steps = samples = empty = 0
    try:
        plan, dataset = worker.plan, loaded["data"]
        n = dataset.train_size
        per_epoch = data.batches_per_epoch(n, plan.batch_size)
        model = worker.model
        model.train()
        log.info(
            "rank %d: %d batches of %d per epoch, %d epochs, on %s",
            worker.rank,
            per_epoch,
            plan.batch_size,
            plan.epochs,
            device,
        )
        perms: dict[int, torch.Tensor] = {}  # this epoch's, and a prefetch's next one
        perms_lock = threading.Lock()  # the training thread and the row prefetch's

        def rows_of(batch: int) -> torch.Tensor:
            epoch, position = divmod(batch, per_epoch)
            with perms_lock:
                if epoch not in perms:
                    for old in [e for e in perms if e < epoch - 1]:
                        del perms[old]
                    perms[epoch] = data.epoch_permutation(n, epoch, plan.seed)
                perm = perms[epoch]
            return perm[position * plan.batch_size : (position + 1) * plan.batch_size]

        table_ids = getattr(model, "table_ids", None)  # the daemon's row prefetch (if any)

        def ids_of(batches: list[int]) -> dict[str, object] | None:
            return table_ids(torch.cat([dataset.batch(rows_of(b))[0] for b in batches]))  # type: ignore[misc]

        prefetch = ids_of if callable(table_ids) and worker.tables else None
        # a batch's rows of every table in one request per shard before its forward pass
        # (which would fetch them table by table): all of them with blocking steps; with
        # prefetching ones, those the background prefetch did not bring or the last push
        # took out of the cache
        fetch_first = prefetch is not None
        if prefetch:
            worker.prefetch_next(prefetch)
        while not worker.finished:
            if cfg.max_steps is not None and steps >= cfg.max_steps:
                log.info("rank %d: --max-steps %d reached; leaving", worker.rank, cfg.max_steps)
                break
            if worker.batch is None:
                # sync, and every batch left is taken this round: count in it, empty-handed.
                worker.step(empty=True)
                empty += 1
                continue
            # One batch, or with --push-every K up to K: their gradients accumulate, each
            # weighted by its share, so the push is the mean gradient over all their samples.
            batches = worker.batches or [worker.batch]
            taken, losses = 0, 0.0
            for batch in batches:
                idx = rows_of(batch)
                x, y = dataset.batch(idx)
                if fetch_first:
                    worker.prefetch(table_ids(x))  # type: ignore[misc]
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x), y)
                (loss / len(batches)).backward()
                taken += len(idx)
                losses += loss.item()
            if cfg.step_delay:
                time.sleep(cfg.step_delay)  # injected straggler (--step-delay)
            worker.step(samples=taken, loss=losses / len(batches))
            if prefetch:
                worker.prefetch_next(prefetch)
            steps += 1
            samples += taken
        worker.close()
    except BaseException:
        worker.close_quietly()
        raise
    seconds = time.perf_counter() - started
    cache = worker.tables.counters
    if worker.tables:
        log.info("rank %d: row caches %d hits, %d misses (%d rows fetched in all)",
                 worker.rank, cache.hits, cache.misses, cache.fetched)  # fmt: skip
    log.info(
        "rank %d finished: %d steps (%d empty), %d samples in %.1fs, %d rejoins",
        worker.rank,
        steps,
        empty,
        samples,
        seconds,
        worker.rejoins,
    )
    return WorkerSummary(worker.rank, steps, samples, seconds, worker.rejoins, cache.hits,
                         cache.misses)  # fmt: skip
