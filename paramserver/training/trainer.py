"""The worker daemon's training loop: shard, forward, backward, step."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.config import WorkerConfig, lazy_dynamo
from paramserver.errors import ConfigError, ServerUnavailable
from paramserver.training import data, losses
from paramserver.training.local_steps import LocalSteps
from paramserver.training.precision import Precision
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
    return {
        **same,
        "device": device,
        "connect_timeout": cfg.server_timeout,  # the first connection too, as its help says
        "overlap": False if cfg.inner_optimizer != "none" else cfg.overlap_flag,
        "shm": cfg.shm != "off",
        "shm_control": cfg.shm == "on",
    }


def run(cfg: WorkerConfig) -> WorkerSummary:
    """Join the server and train on the batches it hands out until the run is finished."""
    torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    loaded: dict[str, data.Data] = {}

    def load(plan: pb.TrainingPlan) -> int:
        loaded["data"] = data.load(plan.dataset, cfg.data_dir, seed=plan.seed)
        return loaded["data"].train_size

    try:
        worker = Worker(cfg.addresses, **worker_arguments(cfg, device), train_samples=load)
    except ServerUnavailable as exc:
        if "is not a parameter server's port" in str(exc):  # said at once, not timed out
            raise
        raise ServerUnavailable(f"{exc} (--server-timeout {cfg.server_timeout:g})") from None
    started = time.perf_counter()
    try:
        steps, samples, empty = _train(cfg, worker, loaded["data"], device)
        worker.close()
    except BaseException:
        worker.close_quietly()
        raise
    seconds = time.perf_counter() - started
    cache = worker.tables.counters
    if worker.tables:
        log.info(
            "rank %d: row caches %d hits, %d misses (%d rows fetched in all)",
            worker.rank,
            cache.hits,
            cache.misses,
            cache.fetched,
        )
    log.info(
        "rank %d finished: %d steps (%d empty), %d samples in %.1fs, %d rejoins",
        worker.rank,
        steps,
        empty,
        samples,
        seconds,
        worker.rejoins,
    )
    if steps == 0:
        log.warning(
            "the run at %s was over before this worker computed a batch: every batch of its "
            "plan is applied (version %d), so there was nothing to train",
            ",".join(cfg.addresses),
            worker.version,
        )
    return WorkerSummary(
        worker.rank, steps, samples, seconds, worker.rejoins, cache.hits, cache.misses
    )


class _Order:
    """The run's batches as rows of the data set: each epoch's seeded permutation, kept for
    that epoch and the next (the row prefetch runs ahead, on its own thread)."""

    def __init__(self, dataset: data.Data, plan: pb.TrainingPlan, per_epoch: int):
        self.dataset, self.plan, self.per_epoch = dataset, plan, per_epoch
        self._perms: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()  # the training thread and the row prefetch's

    def rows(self, batch: int) -> torch.Tensor:
        epoch, position = divmod(batch, self.per_epoch)
        with self._lock:
            if epoch not in self._perms:
                for old in [e for e in self._perms if e < epoch - 1]:
                    del self._perms[old]
                n = self.dataset.train_size
                self._perms[epoch] = data.epoch_permutation(n, epoch, self.plan.seed)
            perm = self._perms[epoch]
        size = self.plan.batch_size
        return perm[position * size : (position + 1) * size]

    def inputs(self, batches: list[int]) -> torch.Tensor:
        return torch.cat([self.dataset.batch(self.rows(b))[0] for b in batches])


def _train(
    cfg: WorkerConfig, worker: Worker, dataset: data.Data, device: torch.device
) -> tuple[int, int, int]:
    """Steps until the run is finished (or ``--max-steps``); (steps, samples, empty steps)."""
    plan = worker.plan
    order = _Order(dataset, plan, data.batches_per_epoch(dataset.train_size, plan.batch_size))
    worker.model.train()
    log.info(
        "rank %d: %d batches of %d per epoch, %d epoch%s, on %s",
        worker.rank,
        order.per_epoch,
        plan.batch_size,
        plan.epochs,
        "" if plan.epochs == 1 else "s",
        device,
    )
    table_ids = getattr(worker.model, "table_ids", None)  # the daemon's row prefetch (if any)
    prefetch = None
    if callable(table_ids) and worker.tables:
        prefetch = lambda batches: table_ids(order.inputs(batches))  # noqa: E731
    # a batch's rows of every table in one request per shard before its forward pass
    # (which would fetch them table by table): all of them with blocking steps; with
    # prefetching ones, those the background prefetch did not bring or the last push
    # took out of the cache
    fetch_first = table_ids if prefetch else None
    precision = Precision(cfg.amp, device)
    if precision.mode == "fp16" and worker.tables:
        raise ConfigError(
            "--amp fp16 scales the loss, and the sparse tables' row gradients are pushed "
            "as they come: use --amp bf16 (no scaling) for a model with sparse tables."
        )
    local = _local_steps(cfg, worker)
    loss_fn = losses.resolve(plan.loss)  # the server's --loss (default: cross-entropy)
    if local is not None and local.flight is not None:
        overlapped = local

        def compute(todo: list[int]) -> tuple[int, float]:
            return _compute(worker, todo, order, device, None, precision, loss_fn, overlapped)

        return _train_overlapped(cfg, worker, local, compute)
    if prefetch:
        worker.prefetch_next(prefetch)
    steps = samples = empty = 0
    if cfg.batch_log:
        worker.landed_batches()  # from now on the worker keeps them (none taken yet)
    while not worker.finished:
        if cfg.max_steps is not None and steps >= cfg.max_steps:
            log.info("rank %d: --max-steps %d reached; leaving", worker.rank, cfg.max_steps)
            break
        if worker.batch is None:
            # sync, and every batch left is taken this round: count in it, empty-handed.
            worker.step(empty=True)
            if local is not None:
                local.anchored()
            empty += 1
            continue
        todo = worker.batches or [worker.batch]
        taken, loss = _compute(worker, todo, order, device, fetch_first, precision, loss_fn, local)
        if not precision.unscaled(worker.model.parameters()):  # fp16 overflow: not pushed
            for p in worker.model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            worker.step(empty=True)  # its batches go back, to be computed again
            empty += 1
            continue
        if cfg.step_delay:
            time.sleep(cfg.step_delay)  # injected straggler (--step-delay)
        if local is not None:
            local.sync(samples=taken, loss=loss)  # the pseudo-gradient, then anchor the pull
        else:
            worker.step(samples=taken, loss=loss)
        if cfg.batch_log:
            _audit(cfg.batch_log, worker.landed_batches())
        if prefetch:
            worker.prefetch_next(prefetch)
        steps += 1
        samples += taken
    if cfg.batch_log:
        worker.flush()  # the pushes still in the background (overlap)
        _audit(cfg.batch_log, worker.landed_batches())
    return steps, samples, empty


def _train_overlapped(
    cfg: WorkerConfig,
    worker: Worker,
    local: LocalSteps,
    compute: Callable[[list[int]], tuple[int, float]],
) -> tuple[int, int, int]:
    """``_train`` with overlapped local steps (``--overlap on``): while a round's exchange is
    in flight, the replica trains the batches its pull named ahead (``PullHeader.next_batches``,
    taken for this worker then). Once it lands, the round just trained is pushed as the
    batches the worker holds, and only if they are the ones trained: otherwise (a rejoin, a
    rewind, the end of the run) its progress is dropped and the worker's batches trained
    anew, so each batch is still applied exactly once. (steps, samples, empty steps)"""
    assert local.flight is not None
    worker.name_next_batches()  # each pull from now on also names the next round's batches
    if cfg.batch_log:
        worker.landed_batches()
    try:
        return _overlapped_rounds(cfg, worker, local, compute)
    except BaseException:
        local.flight.settle(cfg.rpc_timeout)  # not closed under its exchange (run's close)
        raise


def _overlapped_rounds(
    cfg: WorkerConfig,
    worker: Worker,
    local: LocalSteps,
    compute: Callable[[list[int]], tuple[int, float]],
) -> tuple[int, int, int]:
    steps = samples = empty = 0
    todo: list[int] = []  # while a round is in flight: the batches trained meanwhile
    while True:
        if cfg.batch_log:
            _audit(cfg.batch_log, worker.landed_batches())
        if cfg.max_steps is not None and steps >= cfg.max_steps:
            local.land()
            log.info("rank %d: --max-steps %d reached; leaving", worker.rank, cfg.max_steps)
            break
        if not todo:  # nothing in flight, or nothing named ahead (the first round, the end)
            local.land()
            if worker.finished:
                break
            todo = _held(worker)
            if not todo:  # sync, and none left for this round: count in it, empty-handed
                worker.step(empty=True)
                local.anchored()
                empty += 1
                continue
        taken, loss = compute(todo)
        local.land()
        if _held(worker) != todo:  # the worker holds other batches now: train those
            log.info(
                "rank %d: the steps on batches %s.. (trained ahead) are dropped: this worker "
                "holds batches %s now (rejoined, rewound or finished)",
                worker.rank,
                todo[0],
                _held(worker)[:1],
            )
            local.anchored()
            todo = []
            continue
        if cfg.step_delay:
            time.sleep(cfg.step_delay)  # injected straggler (--step-delay)
        todo = list(worker.next_batches)  # the next round's, trained while this one flies
        local.sync(samples=taken, loss=loss)
        steps += 1
        samples += taken
    if cfg.batch_log:
        _audit(cfg.batch_log, worker.landed_batches())
    return steps, samples, empty


def _held(worker: Worker) -> list[int]:
    """The batches the worker holds for its clock (none: an empty round, or the end)."""
    return list(worker.batches) or ([] if worker.batch is None else [worker.batch])


def _audit(path: str, pushes: list[tuple[int, ...]]) -> None:
    """A line for each push whose batches shard 0 took (``--batch-log``; a push the server
    dropped, as after this worker was paused past its lease, has none: its batches went to
    another worker), written through at once: a process killed after it loses no line."""
    if not pushes:
        return
    with open(path, "a") as f:
        f.write("".join(" ".join(map(str, batches)) + "\n" for batches in pushes))


def _local_steps(cfg: WorkerConfig, worker: Worker) -> LocalSteps | None:
    """--inner-optimizer's local steps over the worker's model (None: none)."""
    if cfg.inner_optimizer == "none":
        return None
    kind = torch.optim.AdamW if cfg.inner_optimizer == "adamw" else torch.optim.SGD
    lazy_dynamo.install()  # the inner optimizer without torch._dynamo (2 s of CPU)
    local = LocalSteps(worker, overlap=cfg.overlap == "on")  # --overlap on: the exchange behind
    local.use(kind(local.params, lr=cfg.inner_lr))
    return local


def _compute(
    worker: Worker,
    batches: list[int],
    order: _Order,
    device: torch.device,
    fetch_first: Any,
    precision: Precision,
    loss_fn: losses.Loss,
    local: LocalSteps | None = None,
) -> tuple[int, float]:
    """The gradients of this step's batch, or with --push-every K up to K of them: they
    accumulate, each weighted by its share, so the push is the mean gradient over all their
    samples; with ``local`` (--inner-optimizer) each is a step of the inner optimizer
    instead (``local.sync`` then pushes their pseudo-gradient). (samples, mean loss)."""
    taken, losses = 0, 0.0
    inner_step = local.inner_step if local is not None else None
    model = local.model if local is not None else worker.model
    for batch in batches:
        idx = order.rows(batch)
        x, y = order.dataset.batch(idx)
        if fetch_first is not None:
            worker.prefetch(fetch_first(x))
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with precision.autocast():  # --amp
            loss = loss_fn(model(x), y)
        if local is not None and local.inner is not None:  # one local step a batch
            precision.backward(loss)
            assert inner_step is not None
            inner_step()
            local.inner.zero_grad()
            local.merge()  # overlapped: the new global weights, as soon as they land
        else:
            precision.backward(loss / len(batches))
        taken += len(idx)
        losses += loss.item()
    return taken, losses / len(batches)
