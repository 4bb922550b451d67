"""A worker's settings, and the local cluster's (``launch``: a server's and its workers')."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from paramserver.codec import compression
from paramserver.config.base import (
    _DEVICE,
    AMP_MODES,
    DEFAULT_CACHE_ROWS,
    INNER_OPTIMIZERS,
    MAX_INT64,
    MAX_LOCAL,
    MAX_PUSH_EVERY,
    SHM_CHOICES,
    WIRE_CHOICES,
    Security,
    _positive,
    check_count,
    check_seconds,
)
from paramserver.config.devices import check_gpu
from paramserver.config.server import ServerConfig
from paramserver.errors import ConfigError
from paramserver.settings import REQUIRED, setting, shared


@dataclass(frozen=True)
class WorkerConfig:
    """A worker daemon: where the server is and how to compute."""

    server: str = setting(
        REQUIRED,
        "--server",
        "The server's HOST:PORT; for sharded servers every shard's, in shard order: A,B,... [default: from TF_CONFIG's cluster.ps]",
        dest="server_address",
        cli_default=None,
    )
    device: str = setting("auto", "--device", "auto (CUDA when present), cpu, cuda or cuda:N.")
    threads: int = setting(1, "--threads", "Torch threads per worker process.")
    data_dir: str | None = setting(
        None,
        "--data-dir",
        "Folder of Fashion-MNIST (or MNIST) IDX files [default: Debian's /usr/share/datasets/fashion-mnist].",
    )
    rpc_timeout: float = setting(
        60.0, "--rpc-timeout", "Deadline of each call but pulls, in seconds."
    )
    barrier_timeout: float = setting(
        900.0,
        "--barrier-timeout",
        "Seconds a pull may wait for slower workers before the worker fails.",
    )
    max_steps: int | None = setting(None, "--max-steps", "Stop after this many steps.", type=int)
    step_delay: float = setting(
        0.0, "--step-delay", "Extra seconds per step: simulates a straggler."
    )
    name: str | None = setting(
        None, "--name", "Name shown in the server's status [default: host:pid]."
    )
    batch_log: str | None = setting(
        None,
        "--batch-log",
        "Append the batches of each push the server took to this file, one line a push (an audit of which batches this worker trained; a push the server dropped, as after this worker was paused past its lease, is not listed: its batches went to another worker; but under the server's --backup-workers a push that came after its round closed is answered as taken and its batches are listed again by the worker that redoes them; paramserver chaos reads it).",
    )
    overlap: str = setting(
        "auto",
        "--overlap",
        "Push in the background while the next step computes (ssp:K, async); with --inner-optimizer, the local steps' exchange behind the next H steps (any policy); with shared memory, also fetch the next weights meanwhile; for a model with tables that says its ids (table_ids), also the next batch's rows; auto: on for CUDA, off on CPU (with --inner-optimizer: off).",
        choices=("auto", "on", "off"),
    )
    shm: str = setting(
        "on",
        "--shm",
        "Offer the server a /dev/shm segment for the payloads; used only when the server shares this host (otherwise payloads go as --wire says: the server's data port, or gRPC streams). on: each step's control also goes over the server's same-host socket; payloads: control over gRPC; off: no segment.",
        choices=SHM_CHOICES,
    )
    wire: str = setting(
        "auto",
        "--wire",
        "How payloads reach a server that does not share the segment (another host): auto: over its data port, raw TCP frames with the same TLS and token, when it offers one, else gRPC streams; grpc: gRPC streams always.",
        choices=WIRE_CHOICES,
    )
    compress: str = setting(
        compression.AUTO,
        "--compress",
        "auto, none, fp16, bf16, int8 or topk:F[:fp16|:bf16]. fp16, bf16: gradients pushed and weights pulled in 16 bits (half the bytes on the wire; the server keeps float32 masters and sends a rounded copy); a push's rounding error is kept and added to the next push (error feedback) and its buffers go whole; a pull's integer buffers stay exact. int8: each push's gradient in 8 bits with a float32 scale per 1024 elements (a quarter of float32's bytes), the rounding error kept and added to the next push (error feedback); buffers go whole, pulls in bf16. topk:F: each push sends only the largest fraction F of its gradient's entries (0.01: 1%) as (index, value) pairs, the rest kept and added to the next push (error feedback); pulls stay dense, in the values' type. Through shared memory the values are rounded (quantised, sparsified) in place: the same numbers. auto: a float16 or bfloat16 model's own type, else none.",
    )
    push_every: int = setting(
        1,
        "--push-every",
        "Compute K of the server's batches, accumulating their gradients, per push: K times fewer round trips, K times the batch per optimizer step.",
    )
    cache_rows: int = setting(
        DEFAULT_CACHE_ROWS,
        "--cache-rows",
        "Sparse tables: the most rows each table keeps on a worker (a batch's distinct ids must fit).",
    )
    inner_optimizer: str = setting(
        "none",
        "--inner-optimizer",
        "Local steps (DiLoCo): with sgd or adamw, each of the --push-every H batches a pull hands out is one step of this optimizer on the worker's own replica, and the push is the pseudo-gradient (the weights pulled minus the weights after the H steps) for the server's outer optimizer (DiLoCo's: --optimizer nesterov --lr 0.7 on the server). With --overlap on, the push and the pull of the new global weights go on in the background while the next H steps train (on the batches the pull named ahead), and the weights are merged in as they land, keeping those steps (auto: off). none: the H batches' gradients accumulate into one push. Needs --amp off or bf16.",
        choices=INNER_OPTIMIZERS,
    )
    inner_lr: float = setting(
        1e-3, "--inner-lr", "The learning rate of --inner-optimizer's local steps."
    )
    amp: str = setting(
        "off",
        "--amp",
        "Mixed precision of the built-in worker's forward and backward passes: bf16 (autocast in bfloat16), fp16 (autocast in float16 with a dynamic loss scale: a step whose gradients overflow is not pushed, its batches go back and the scale halves) or off. The model, its gradients and the server's masters stay float32.",
        choices=AMP_MODES,
    )
    server_timeout: float = setting(
        300.0,
        "--server-timeout",
        "Seconds to wait for a server that does not answer, before the worker gives up: at the first connection (saying every 10 s whom it waits for and until when), and once joined while a server is unreachable, e.g. restarting (retrying with backoff and jitter).",
    )
    security: Security = field(default_factory=Security)

    def __post_init__(self) -> None:
        for address in self.addresses:
            _check_address(address)
        _check_compute(self.device, self.threads)
        check_seconds("--rpc-timeout", self.rpc_timeout)
        check_seconds("--barrier-timeout", self.barrier_timeout)
        if self.max_steps is not None:
            check_count("--max-steps", self.max_steps, 1, MAX_INT64)
        check_seconds("--step-delay", self.step_delay, zero=True)
        _check_overlap(self.overlap)
        _check_shm(self.shm)
        _check_wire(self.wire)
        _check_compress(self.compress)
        _check_push_every(self.push_every)
        _check_amp(self.amp)
        _check_local(self.inner_optimizer, self.inner_lr, self.amp)
        check_count("--cache-rows", self.cache_rows)  # rows allocated up front, per table
        check_seconds("--server-timeout", self.server_timeout)

    @property
    def addresses(self) -> list[str]:
        """--server as a list: one address, or every shard's (A,B,...)."""
        return [a.strip() for a in self.server.split(",")]

    @property
    def overlap_flag(self) -> bool | None:
        """--overlap as the Worker argument: None for auto."""
        return None if self.overlap == "auto" else self.overlap == "on"


def _check_compute(device: str, threads: int) -> None:
    if not _DEVICE.match(device):
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N; got {device!r}.")
    check_count("--threads", threads, 1, MAX_LOCAL)


def _check_address(address: str) -> None:
    if not re.match(r"^[^:\s]+:\d+$", address) and not address.startswith(("unix:", "[")):
        raise ConfigError(
            f"--server must look like HOST:PORT (e.g. 127.0.0.1:50051), or a comma-separated "
            f"list of them for sharded servers; got {address!r}."
        )
    port = address.rsplit(":", 1)[-1]
    if not address.startswith("unix:") and not (port.isdigit() and 0 < int(port) <= 65535):
        raise ConfigError(f"--server {address!r} has no valid port (1 to 65535).")


def _check_push_every(value: int) -> None:
    check_count("--push-every", value, 1, MAX_PUSH_EVERY)


def _check_compress(value: str) -> None:
    try:
        compression.by_name(value)
    except ValueError as exc:
        raise ConfigError(f"--{exc}") from None


def _check_wire(value: str) -> None:
    if value not in WIRE_CHOICES:
        raise ConfigError(f"--wire must be one of {', '.join(WIRE_CHOICES)}; got {value!r}.")


def _check_shm(value: str) -> None:
    if value not in SHM_CHOICES:
        raise ConfigError(f"--shm must be one of {', '.join(SHM_CHOICES)}; got {value!r}.")


def _check_local(inner: str, lr: float, amp: str) -> None:
    if inner not in INNER_OPTIMIZERS:
        raise ConfigError(
            f"--inner-optimizer must be one of {', '.join(INNER_OPTIMIZERS)}; got {inner!r}."
        )
    _positive("--inner-lr", lr)
    if inner != "none" and amp == "fp16":
        raise ConfigError("--inner-optimizer with --amp fp16 is not supported: use bf16.")


def _check_amp(value: str) -> None:
    if value not in AMP_MODES:
        raise ConfigError(f"--amp must be one of {', '.join(AMP_MODES)}; got {value!r}.")


def _check_overlap(value: str) -> None:
    if value not in ("auto", "on", "off"):
        raise ConfigError(f"--overlap must be auto, on or off; got {value!r}.")


def _as_in_worker(name: str) -> Any:
    """A launch setting that is the worker daemon's: the same default, flag and help."""
    f = WorkerConfig.__dataclass_fields__[name]
    return field(default=f.default, metadata=f.metadata)


@dataclass(frozen=True)
class LaunchConfig:
    """A local cluster: one server process and ``server.workers`` worker processes."""

    server: ServerConfig
    device: str = _as_in_worker("device")
    threads: int = _as_in_worker("threads")
    data_dir: str | None = _as_in_worker("data_dir")
    runs_root: str = setting("runs", "--runs-dir", "Where run folders are made.")
    run_dir: str | None = setting(
        None,
        "--run-dir",
        "The run folder: config.json, metrics.jsonl (the test figures after each epoch), curve.png, summary.json. launch: exactly this folder [default: a new one under --runs-dir]. server: auto (the default): CHECKPOINT_DIR/run with --checkpoint-dir, else a new one under runs/; off: no evaluation. A shard of a sharded server run evaluates nothing (it holds a slice).",
    )
    step_delay: float = _as_in_worker("step_delay")
    startup_timeout: float = 120.0
    progress: bool = setting(True, "--progress/--no-progress", "Show a progress bar on stderr.")
    overlap: str = _as_in_worker("overlap")
    shm: str = _as_in_worker("shm")
    wire: str = _as_in_worker("wire")
    compress: str = _as_in_worker("compress")
    push_every: int = _as_in_worker("push_every")
    cache_rows: int = _as_in_worker("cache_rows")
    inner_optimizer: str = _as_in_worker("inner_optimizer")
    inner_lr: float = _as_in_worker("inner_lr")
    amp: str = _as_in_worker("amp")
    servers: int = setting(
        1,
        "--servers",
        "Server processes, each holding one shard of the parameters (--shard I/S).",
        type=int,
    )

    def __post_init__(self) -> None:
        _check_compute(self.device, self.threads)
        check_gpu(self.device, "--device")  # before anything starts, not in each worker
        check_seconds("--step-delay", self.step_delay, zero=True)
        check_seconds("--startup-timeout", self.startup_timeout)
        _check_overlap(self.overlap)
        _check_shm(self.shm)
        _check_wire(self.wire)
        _check_compress(self.compress)
        _check_push_every(self.push_every)
        _check_amp(self.amp)
        _check_local(self.inner_optimizer, self.inner_lr, self.amp)
        check_count("--cache-rows", self.cache_rows)
        check_count("--servers", self.servers, 1, 64)  # processes on this one host

    def worker(self, address: str, name: str) -> WorkerConfig:
        """The config of one of this launch's workers: its worker settings are the
        daemon's own (``_as_in_worker``)."""
        return WorkerConfig(address, name=name, **shared(self, WorkerConfig))
