"""Frozen, validated settings; each field the command line sets declares its flag, variable
and help (``settings.setting``). Every field is checked in ``__post_init__``; a bad value
raises ConfigError with a sentence that names the setting (its flag) and the value.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from paramserver.codec import compression
from paramserver.errors import ConfigError
from paramserver.policy.staleness import Policy
from paramserver.settings import REQUIRED, setting, shared

DEFAULT_CACHE_ROWS = 1 << 16  # a sparse table's rows on a worker (``sparse/embedding.py``)

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
LR_SCHEDULES = ("constant", "cosine")
SHM_CHOICES = ("on", "payloads", "off")
DATASETS = ("fashion-mnist", "synthetic", "clicks")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
# The most batches a worker computes per push (--push-every K); the server enforces it too.
MAX_PUSH_EVERY = 1024
# What a built-in model brings on the command line (``server``, ``launch``) for settings left
# at their defaults: the run that reaches the accuracy docs/RESULTS.md reports. Keys are the
# click parameters' names.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "resnet": {"epochs": 10, "lr": 2e-3},
    "dlrm": {"dataset": "clicks", "epochs": 2, "batch_size": 256, "lr": 1e-2},
}
MODEL_DEFAULTS["dlrm-sparse"] = MODEL_DEFAULTS["dlrm"]


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be positive; got {value!r}.")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{name} must be zero or more; got {value!r}.")


@dataclass(frozen=True)
class OptimizerConfig:
    """The server-side optimizer."""

    name: str = setting("adam", "--optimizer", "Server-side optimizer.", dest="optimizer",
                        choices=OPTIMIZERS)  # fmt: skip
    lr: float = setting(1e-3, "--lr", "Learning rate.")
    momentum: float = setting(0.9, "--momentum", "Momentum (optimizer 'momentum' only).")
    weight_decay: float = setting(0.0, "--weight-decay", "Weight decay.")
    schedule: str = setting("constant", "--lr-schedule", "constant, or cosine decay to 0 over "
                            "--lr-total-steps optimizer steps.", choices=LR_SCHEDULES,
                            dest="lr_schedule")  # fmt: skip
    total_steps: int | None = setting(None, "--lr-total-steps", "Optimizer steps the cosine "
                                      "schedule spans [launch: the whole run].", type=int,
                                      dest="lr_total_steps")  # fmt: skip

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(
                f"Unknown optimizer (--optimizer) {self.name!r}: choose one of {', '.join(OPTIMIZERS)}."
            )
        _positive("The learning rate (--lr)", self.lr)
        _non_negative("--momentum", self.momentum)
        _non_negative("--weight-decay", self.weight_decay)
        if self.schedule not in LR_SCHEDULES:
            raise ConfigError(
                f"Unknown learning-rate schedule (--lr-schedule) {self.schedule!r}: choose one "
                f"of {', '.join(LR_SCHEDULES)}."
            )
        if self.schedule == "cosine" and (self.total_steps is None or self.total_steps < 1):
            raise ConfigError(
                "--lr-schedule cosine needs --lr-total-steps, the number of optimizer steps "
                f"it decays over (at least 1); got {self.total_steps!r}."
            )

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        if self.schedule == "constant" or self.total_steps is None:
            return self.lr
        progress = min(step, self.total_steps) / self.total_steps
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Security:
    """TLS files and the shared token, the same options on servers and workers.

    Server: ``cert``/``key`` serve TLS; with ``ca`` too, clients must present a
    certificate signed by it (mutual TLS). Worker: ``ca`` verifies the server;
    ``cert``/``key`` are the client certificate. ``token``: every call carries it and the
    server refuses calls without it.
    """

    cert: str | None = setting(None, "--tls-cert", "PEM certificate: the server's, or the worker's client certificate.", dest="tls_cert")  # fmt: skip
    key: str | None = setting(None, "--tls-key", "PEM private key of --tls-cert.", dest="tls_key")  # fmt: skip
    ca: str | None = setting(None, "--tls-ca", "PEM CA bundle: on the server, clients must present a certificate it signed (mutual TLS); on clients, it verifies the server.", dest="tls_ca")  # fmt: skip
    token: str | None = setting(None, "--token", "Shared secret: the server refuses calls without it (UNAUTHENTICATED). Prefer the variable to the flag, which shows in ps.", secret=True)  # fmt: skip

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("--tls-cert and --tls-key go together: give both or neither.")
        for option, path in (
            ("--tls-cert", self.cert),
            ("--tls-key", self.key),
            ("--tls-ca", self.ca),
        ):
            if path and not os.path.isfile(path):
                raise ConfigError(f"{option} {path!r} is not a readable file.")
        if self.token is not None and not self.token.strip():
            raise ConfigError("--token (PARAMSERVER_TOKEN) is set but empty.")

    @property
    def tls(self) -> bool:
        return bool(self.cert or self.ca)

    def read(self, which: str) -> bytes | None:
        path = getattr(self, which)
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    def __repr__(self) -> str:  # never print the token
        token = "set" if self.token else None
        return f"Security(cert={self.cert!r}, key={self.key!r}, ca={self.ca!r}, token={token})"


def parse_shard(text: str) -> tuple[int, int]:
    """``--shard I/S`` as (I, S).

    Raises:
        ConfigError: not two integers with 0 <= I < S.
    """
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if match is None or not 0 <= int(match[1]) < int(match[2]):
        raise ConfigError(f"--shard must be I/S with 0 <= I < S, e.g. 0/2; got {text!r}.")
    return int(match[1]), int(match[2])


def _shard_fields(text: str) -> dict[str, int]:
    index, shards = parse_shard(text)
    return {"shard": index, "shards": shards}


def parse_every(text: str) -> tuple[int | None, float | None]:
    """``--checkpoint-every``: ``N`` optimizer steps or ``Ns`` seconds (also ``Nm``).

    Raises:
        ConfigError: neither form.
    """
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(s|m)?\s*$", text or "")
    if m and m.group(2):
        seconds = float(m.group(1)) * (60 if m.group(2) == "m" else 1)
        if seconds > 0:
            return None, seconds
    elif m and "." not in m.group(1) and int(m.group(1)) > 0:
        return int(m.group(1)), None
    raise ConfigError(
        f"--checkpoint-every must be a number of optimizer steps (500) or of seconds (30s, "
        f"5m), above zero; got {text!r}."
    )


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server needs: the model, optimizer, policy and the training plan."""

    model: str = setting(
        "mlp",
        "--model",
        "Model factory: mlp, cnn, resnet, dlrm (a click model for --dataset clicks), dlrm-sparse (dlrm with its tables held by the servers row by row) or module:function. On the command line a built-in model brings its own defaults for what is not given (resnet: 10 epochs at lr 0.002; dlrm and dlrm-sparse: the clicks data set, 2 epochs, batches of 256, lr 0.01).",
    )
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    policy: str = setting("delay-1", "--policy", "Staleness policy: sync, delay-1, ssp:K or async.")  # fmt: skip
    workers: int = setting(1, "--workers", "Most workers live at once; training starts when --min-workers have joined.", cli_default=2)  # fmt: skip
    dataset: str = setting("fashion-mnist", "--dataset", "Training data: fashion-mnist, synthetic, clicks (a synthetic click log, for --model dlrm), or module:function returning (train, test), map-style torch Datasets of (input, label) pairs, importable on the workers and by launch.")  # fmt: skip
    batch_size: int = setting(64, "--batch-size", "Batch size of each worker.")
    epochs: int = setting(1, "--epochs", "Passes over the training set.", cli_default=8)
    seed: int = setting(0, "--seed", "Seeds the initial weights and the data order.")
    host: str = setting("0.0.0.0", "--host", "Address to listen on.")
    port: int = setting(50051, "--port", "Port to listen on (0: any free port).")
    lease_seconds: float = setting(10.0, "--lease-timeout", "Seconds without a call after which a worker is dropped from every barrier.")  # fmt: skip
    chunk_bytes: int = setting(
        1 << 20, "--chunk-bytes", "Size of the streamed payload chunks (4 KiB to 16 MiB)."
    )
    threads: int = setting(1, "--threads", "Torch threads of the optimizer.", env="SERVER_THREADS", dest="server_threads")  # fmt: skip
    barrier_timeout: float = 600.0
    min_workers: int | None = setting(None, "--min-workers", "Workers that must join before training starts [default: --workers]; more may join later.", type=int)  # fmt: skip
    checkpoint_dir: str | None = setting(None, "--checkpoint-dir", "Save the server's state here (and on SIGTERM); resume from it at start-up when it holds one.")  # fmt: skip
    checkpoint_every: str = setting("60s", "--checkpoint-every", "With --checkpoint-dir: every N optimizer steps (500) or N seconds (30s, 5m); shards: every N iterations, a consistent cut.")  # fmt: skip
    optimizer_thread: bool = setting(False, "--optimizer-thread", "Apply every push on one optimizer thread that the request threads hand pushes to (measured slower on CPU: see docs/BENCHMARKS.md).", is_flag=True)  # fmt: skip
    table_rows: int = setting(0, "--table-rows", "Also hold as a sparse table on the servers every trainable nn.Embedding or nn.EmbeddingBag of at least this many rows, built with sparse=True or not (0: only those built with sparse=True).")  # fmt: skip
    skip_nonfinite: bool = setting(False, "--skip-nonfinite", "Skip and count gradients holding NaN or Inf instead of failing the push.", is_flag=True)  # fmt: skip
    security: Security = field(default_factory=Security)
    shard: int = setting(0, "--shard", "I/S: hold the I-th of S equal contiguous ranges of the flat parameters; run one server per shard and give workers every address, in order (--server A,B,...). auto: I is the host name's ordinal (a StatefulSet pod's), S is PARAMSERVER_SHARDS.", type=str, cli_default="0/1", parse=_shard_fields, show=lambda c: f"{c.shard}/{c.shards}")  # fmt: skip
    shards: int = 1  # of the shard above: --shard I/S
    metrics_port: int | None = setting(None, "--metrics-port", "Serve Prometheus metrics on http://METRICS_HOST:PORT/metrics [default: off].", type=int)  # fmt: skip
    metrics_host: str = setting("127.0.0.1", "--metrics-host", "Address the metrics listen on; 0.0.0.0 opens them to every interface (no token guards them: they show worker names and the loss).")  # fmt: skip

    def __post_init__(self) -> None:
        Policy.parse(self.policy)
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1; got {self.workers}.")
        if self.min_workers is not None and not 1 <= self.min_workers <= self.workers:
            raise ConfigError(
                f"--min-workers must be between 1 and --workers ({self.workers}); got "
                f"{self.min_workers}."
            )
        parse_every(self.checkpoint_every)
        if self.dataset not in DATASETS and not re.fullmatch(r"[\w.]+:\w+", self.dataset):
            raise ConfigError(
                f"Unknown dataset (--dataset) {self.dataset!r}: choose one of "
                f"{', '.join(DATASETS)}, or module:function."
            )
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1; got {self.batch_size}.")
        if self.epochs < 1:
            raise ConfigError(f"--epochs must be at least 1; got {self.epochs}.")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be between 0 and 65535; got {self.port}.")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"--metrics-port must be between 0 and 65535; got {self.metrics_port}."
            )
        _positive("--lease-timeout", self.lease_seconds)
        _non_negative("--table-rows", self.table_rows)
        if not 4096 <= self.chunk_bytes <= 16 << 20 or self.chunk_bytes % 4:
            raise ConfigError(
                "--chunk-bytes must be a multiple of 4 from 4096 to 16777216 (16 MiB); got "
                f"{self.chunk_bytes}."
            )
        if self.threads < 1:
            raise ConfigError(f"--threads must be at least 1; got {self.threads}.")
        _positive("--barrier-timeout", self.barrier_timeout)
        if not 0 <= self.shard < self.shards:
            raise ConfigError(
                f"--shard must be I/S with 0 <= I < S; got {self.shard}/{self.shards}."
            )
        if self.cuts and parse_every(self.checkpoint_every)[0] is None:
            raise ConfigError(
                "A shard of a sharded run checkpoints every N iterations (sync rounds, or "
                "worker clocks), so that every shard cuts at the same point: give "
                f"--checkpoint-every a number (e.g. 200), not {self.checkpoint_every!r}."
            )

    @property
    def parsed_policy(self) -> Policy:
        return Policy.parse(self.policy)

    @property
    def cuts(self) -> bool:
        """Whether this server writes consistent cuts: a shard of a sharded run that
        checkpoints."""
        return self.shards > 1 and bool(self.checkpoint_dir)

    @property
    def start_workers(self) -> int:
        """Joins the run waits for before the first pull is answered."""
        return self.workers if self.min_workers is None else self.min_workers


@dataclass(frozen=True)
class WorkerConfig:
    """A worker daemon: where the server is and how to compute."""

    server: str = setting(REQUIRED, "--server", "The server's HOST:PORT; for sharded servers every shard's, in shard order: A,B,... [default: from TF_CONFIG's cluster.ps]", dest="server_address", cli_default=None)  # fmt: skip
    device: str = setting("auto", "--device", "auto (CUDA when present), cpu, cuda or cuda:N.")
    threads: int = setting(1, "--threads", "Torch threads per worker process.")
    data_dir: str | None = setting(None, "--data-dir", "Folder of Fashion-MNIST (or MNIST) IDX files [default: Debian's /usr/share/datasets/fashion-mnist].")  # fmt: skip
    rpc_timeout: float = setting(60.0, "--rpc-timeout", "Deadline of each call but pulls, in seconds.")  # fmt: skip
    barrier_timeout: float = setting(900.0, "--barrier-timeout", "Seconds a pull may wait for slower workers before the worker fails.")  # fmt: skip
    max_steps: int | None = setting(None, "--max-steps", "Stop after this many steps.", type=int)
    step_delay: float = setting(0.0, "--step-delay", "Extra seconds per step: simulates a straggler.")  # fmt: skip
    name: str | None = setting(None, "--name", "Name shown in the server's status [default: host:pid].")  # fmt: skip
    overlap: str = setting("auto", "--overlap", "Push in the background while the next step computes (ssp:K, async); with shared memory, also fetch the next weights meanwhile; auto: on for CUDA, off on CPU.", choices=("auto", "on", "off"))  # fmt: skip
    shm: str = setting("on", "--shm", "Offer the server a /dev/shm segment for the payloads; used only when the server shares this host (otherwise gRPC streams). on: each step's control also goes over the server's same-host socket; payloads: control over gRPC; off: no segment.", choices=SHM_CHOICES)  # fmt: skip
    compress: str = setting(compression.AUTO, "--compress", "Element type of gradients streamed over gRPC (fp16, bf16: half the bytes; the server keeps float32); auto: a float16 or bfloat16 model's own, else none. Not used through shared memory.", choices=compression.CHOICES)  # fmt: skip
    push_every: int = setting(1, "--push-every", "Compute K of the server's batches, accumulating their gradients, per push: K times fewer round trips, K times the batch per optimizer step.")  # fmt: skip
    cache_rows: int = setting(DEFAULT_CACHE_ROWS, "--cache-rows", "Sparse tables: the most rows each table keeps on a worker (a batch's distinct ids must fit).")  # fmt: skip
    server_timeout: float = setting(300.0, "--server-timeout", "Seconds to keep retrying (backoff with jitter) while the server is unreachable, e.g. restarting, before the worker gives up.")  # fmt: skip
    security: Security = field(default_factory=Security)

    def __post_init__(self) -> None:
        for address in self.addresses:
            _check_address(address)
        _check_compute(self.device, self.threads)
        _positive("--rpc-timeout", self.rpc_timeout)
        _positive("--barrier-timeout", self.barrier_timeout)
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"--max-steps must be at least 1; got {self.max_steps}.")
        _non_negative("--step-delay", self.step_delay)
        _check_overlap(self.overlap)
        _check_shm(self.shm)
        _check_compress(self.compress)
        _check_push_every(self.push_every)
        _positive("--cache-rows", self.cache_rows)
        _positive("--server-timeout", self.server_timeout)

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
    if threads < 1:
        raise ConfigError(f"--threads must be at least 1; got {threads}.")


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
    if not 1 <= value <= MAX_PUSH_EVERY:
        raise ConfigError(f"--push-every must be 1 to {MAX_PUSH_EVERY}; got {value}.")


def _check_compress(value: str) -> None:
    try:
        compression.by_name(value)
    except ValueError as exc:
        raise ConfigError(f"--{exc}") from None


def _check_shm(value: str) -> None:
    if value not in SHM_CHOICES:
        raise ConfigError(f"--shm must be one of {', '.join(SHM_CHOICES)}; got {value!r}.")


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
    run_dir: str | None = setting(None, "--run-dir", "Use exactly this run folder.")
    step_delay: float = _as_in_worker("step_delay")
    startup_timeout: float = 120.0
    progress: bool = setting(True, "--progress/--no-progress", "Show a progress bar on stderr.")
    overlap: str = _as_in_worker("overlap")
    shm: str = _as_in_worker("shm")
    compress: str = _as_in_worker("compress")
    push_every: int = _as_in_worker("push_every")
    cache_rows: int = _as_in_worker("cache_rows")
    servers: int = setting(1, "--servers", "Server processes, each holding one shard of the parameters (--shard I/S).", type=int)  # fmt: skip

    def __post_init__(self) -> None:
        _check_compute(self.device, self.threads)
        _non_negative("--step-delay", self.step_delay)
        _positive("--startup-timeout", self.startup_timeout)
        _check_overlap(self.overlap)
        _check_shm(self.shm)
        _check_compress(self.compress)
        _check_push_every(self.push_every)
        if not 1 <= self.servers <= 64:
            raise ConfigError(f"--servers must be 1 to 64; got {self.servers}.")

    def worker(self, address: str, name: str) -> WorkerConfig:
        """The config of one of this launch's workers: its worker settings are the
        daemon's own (``_as_in_worker``)."""
        return WorkerConfig(address, name=name, **shared(self, WorkerConfig))
