"""Frozen, validated settings: click -> config -> build.

Every field is checked in ``__post_init__``; a bad value raises ConfigError with a sentence
that names the setting and the value.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from paramserver.codec import compression
from paramserver.errors import ConfigError
from paramserver.staleness import Policy

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
LR_SCHEDULES = ("constant", "cosine")
DATASETS = ("fashion-mnist", "synthetic")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be positive; got {value!r}.")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{name} must be zero or more; got {value!r}.")


@dataclass(frozen=True)
class OptimizerConfig:
    """The server-side optimizer."""

    name: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9  # used by "momentum" only
    weight_decay: float = 0.0
    schedule: str = "constant"
    total_steps: int | None = None  # optimizer steps the cosine schedule spans

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

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    token: str | None = None

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

    model: str = "mlp"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    policy: str = "delay-1"
    workers: int = 1
    dataset: str = "fashion-mnist"
    batch_size: int = 64
    epochs: int = 1
    seed: int = 0
    host: str = "0.0.0.0"
    port: int = 50051
    lease_seconds: float = 10.0
    chunk_bytes: int = 1 << 20
    threads: int = 1
    barrier_timeout: float = 600.0
    min_workers: int | None = None  # joins training waits for; None: ``workers``
    checkpoint_dir: str | None = None
    checkpoint_every: str = "60s"
    skip_nonfinite: bool = False
    security: Security = field(default_factory=Security)
    shard: int = 0  # which shard of the flat parameters this server holds (--shard I/S)
    shards: int = 1
    metrics_port: int | None = None  # Prometheus /metrics on host:metrics_port; None: off

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
        if self.dataset not in DATASETS:
            raise ConfigError(
                f"Unknown dataset (--dataset) {self.dataset!r}: choose one of {', '.join(DATASETS)}."
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
        if self.chunk_bytes < 4096 or self.chunk_bytes % 4:
            raise ConfigError(
                f"--chunk-bytes must be a multiple of 4 and at least 4096; got {self.chunk_bytes}."
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
                "A shard of a sharded sync run checkpoints every N optimizer steps, so that "
                "every shard cuts the same round: give --checkpoint-every a number of steps "
                f"(e.g. 200), not {self.checkpoint_every!r}."
            )

    @property
    def parsed_policy(self) -> Policy:
        return Policy.parse(self.policy)

    @property
    def cuts(self) -> bool:
        """Whether this server writes consistent cuts: a shard of a sharded sync run."""
        return self.shards > 1 and self.parsed_policy.synchronous and bool(self.checkpoint_dir)

    @property
    def start_workers(self) -> int:
        """Joins the run waits for before the first pull is answered."""
        return self.workers if self.min_workers is None else self.min_workers


@dataclass(frozen=True)
class WorkerConfig:
    """A worker daemon: where the server is and how to compute."""

    server: str
    device: str = "auto"
    threads: int = 1
    data_dir: str | None = None
    rpc_timeout: float = 60.0
    barrier_timeout: float = 900.0
    max_steps: int | None = None
    step_delay: float = 0.0
    name: str | None = None
    overlap: str = "auto"
    shm: str = "on"
    compress: str = "none"
    push_every: int = 1
    server_timeout: float = 300.0
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
    if not 1 <= value <= 1024:
        raise ConfigError(f"--push-every must be 1 to 1024; got {value}.")


def _check_compress(value: str) -> None:
    try:
        compression.by_name(value)
    except ValueError as exc:
        raise ConfigError(f"--{exc}") from None


def _check_shm(value: str) -> None:
    if value not in ("on", "off"):
        raise ConfigError(f"--shm must be on or off; got {value!r}.")


def _check_overlap(value: str) -> None:
    if value not in ("auto", "on", "off"):
        raise ConfigError(f"--overlap must be auto, on or off; got {value!r}.")


@dataclass(frozen=True)
class LaunchConfig:
    """A local cluster: one server process and ``server.workers`` worker processes."""

    server: ServerConfig
    device: str = "auto"
    threads: int = 1
    data_dir: str | None = None
    runs_root: str = "runs"
    run_dir: str | None = None
    step_delay: float = 0.0
    startup_timeout: float = 120.0
    progress: bool = True
    overlap: str = "auto"
    shm: str = "on"
    compress: str = "none"
    push_every: int = 1
    servers: int = 1  # server shards

    def __post_init__(self) -> None:
        _check_compute(self.device, self.threads)
        _non_negative("--step-delay", self.step_delay)
        _positive("--startup-timeout", self.startup_timeout)
        _check_overlap(self.overlap)
        _check_shm(self.shm)
        _check_compress(self.compress)
        _check_push_every(self.push_every)
        if self.servers < 1:
            raise ConfigError(f"--servers must be at least 1; got {self.servers}.")
