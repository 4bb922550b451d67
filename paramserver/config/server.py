"""A server's settings: the model, optimizer, policy and the training plan."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from paramserver.config.base import (
    DATASETS,
    MAX_EPOCHS,
    MAX_INT64,
    MAX_LOCAL,
    MAX_SEED,
    MAX_SHARDS,
    Security,
    _non_negative,
    _shard_fields,
    check_count,
    check_seconds,
    parse_every,
    parse_table_optimizers,
)
from paramserver.config.devices import check_server_device
from paramserver.config.optimizer import OptimizerConfig
from paramserver.errors import ConfigError
from paramserver.policy.staleness import Policy
from paramserver.settings import setting

# --delay-compensation's C for a model with sparse tables (docs/architecture.md, What the
# benchmarks taught: the Criteo-like DLRM's 2 async workers, C 1 and 3 against 0 at a tenth
# of its size, 3 at full size).
DEFAULT_COMPENSATION = 3.0
_WITH_SECOND_MOMENT = ("adam", "adamw")  # the optimizers whose v the compensation scales by


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server needs: the model, optimizer, policy and the training plan."""

    model: str = setting(
        "mlp",
        "--model",
        "Model factory: mlp, cnn, resnet, dlrm (a click model for --dataset clicks), dlrm-sparse (dlrm with its tables held by the servers row by row), gpt-tiny (a byte-level transformer language model, its head tied to the token embedding, for --dataset text) or module:function. On the command line a built-in model brings its own defaults for what is not given (resnet: 10 epochs at lr 0.002; dlrm and dlrm-sparse: the clicks data set, 2 epochs, batches of 256, lr 0.01; gpt-tiny: the text data set, 1 epoch, batches of 32).",
    )
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    policy: str = setting(
        "delay-1",
        "--policy",
        "Staleness policy: sync, delay-1, ssp:K (delay-K is the same) or async.",
    )
    workers: int = setting(
        1,
        "--workers",
        "Most workers live at once; training starts when --min-workers have joined.",
        cli_default=2,
    )
    dataset: str = setting(
        "fashion-mnist",
        "--dataset",
        "Training data: fashion-mnist, synthetic, clicks (a synthetic click log, for --model dlrm), text (this Python's standard library as 64-byte windows, for --model gpt-tiny), or module:function returning (train, test), map-style torch Datasets of (input, label) pairs, importable on the workers and by launch.",
    )
    loss: str = setting(
        "",
        "--loss",
        "The training loss the workers compute and the server's test loss: module:function, called as loss(outputs, targets) and returning the batch's mean (torch.nn.functional:l1_loss fits as it is), importable on the workers and the server. Default: cross-entropy, token by token for a sequence model's (B, T, V) logits against (B, T) targets, its test figures per token with the perplexity.",
    )
    batch_size: int = setting(64, "--batch-size", "Batch size of each worker.")
    epochs: int = setting(1, "--epochs", "Passes over the training set.", cli_default=8)
    seed: int = setting(0, "--seed", "Seeds the initial weights and the data order.")
    host: str = setting(
        "0.0.0.0",
        "--host",
        "Address to listen on (every interface by default; without a token or TLS the log "
        "warns: see PARAMSERVER_TOKEN, --tls-cert).",
    )
    port: int = setting(50051, "--port", "Port to listen on (0: any free port).")
    data_port: str = setting(
        "auto",
        "--data-port",
        "Port of the data path that workers on other hosts push and pull over (raw TCP frames, with the same TLS and token as gRPC). auto: --port + 1 (any free port with --port 0); off: none, payloads stream over gRPC; or a port number (0: any free port).",
    )
    lease_seconds: float = setting(
        10.0,
        "--lease-timeout",
        "Seconds without a call after which a worker is dropped from every barrier.",
    )
    chunk_bytes: int = setting(
        1 << 20, "--chunk-bytes", "Size of the streamed payload chunks (4 KiB to 16 MiB)."
    )
    threads: int | None = setting(
        None,
        "--server-threads",
        "Threads of the optimizer (torch's), of the finiteness check and of the copies out of "
        "shared memory [default: the host's usable cores (CPU affinity, capped by a cgroup CPU "
        "quota) over the shards started on it: all of them for a server, cores/S each for "
        "launch's S shards; the server's log says the number and where it came from].",
        type=int,
        env="SERVER_THREADS",
        dest="server_threads",
    )
    server_device: str = setting(
        "cpu",
        "--server-device",
        "Where this shard holds its weights, optimizer state and incoming gradients, and runs "
        "its optimizer: cpu, cuda (launch spreads its shards over the host's GPUs) or cuda:I. "
        "Pulls, checkpoints and exports read a copy on the host: the same files either way.",
    )
    barrier_timeout: float = 600.0
    min_workers: int | None = setting(
        None,
        "--min-workers",
        "Workers that must join before training starts [default: --workers]; more may join later.",
        type=int,
    )
    backup_workers: int = setting(
        0,
        "--backup-workers",
        "sync only: a round closes once all live workers but B have pushed; a gradient that comes after its round closed is dropped (counted) and its batches are handed out again, so a straggler does not hold the others back. One server shard only.",
    )
    checkpoint_dir: str | None = setting(
        None,
        "--checkpoint-dir",
        "Save the server's state here (and on SIGTERM); resume from it at start-up when it holds one.",
    )
    forget_workers: bool = setting(
        False,
        "--forget-workers",
        "On resuming from --checkpoint-dir, drop at once the workers the checkpoint names (their batches go back to the queue) instead of waiting three leases for them to come back: for a launcher that started them and knows they are gone (launch sets it on the servers it starts).",
        is_flag=True,
    )
    switch_optimizer: bool = setting(
        False,
        "--switch-optimizer",
        "On resuming from --checkpoint-dir a checkpoint written under another --optimizer, start this optimizer's state afresh (the weights and the rest of the run go on) instead of refusing to start. A checkpoint of the same optimizer keeps its state either way, stepped with this command line's --lr, --momentum, --weight-decay, --nesterov-period and schedule (the log names those that changed).",
        is_flag=True,
    )
    checkpoint_every: str = setting(
        "60s",
        "--checkpoint-every",
        "With --checkpoint-dir: every N optimizer steps (500) or N seconds (30s, 5m); shards: every N iterations, a consistent cut.",
    )
    checkpoint_delta_every: int = setting(
        8,
        "--checkpoint-delta-every",
        "Sparse tables: each checkpoint writes only the rows changed since the previous one (a delta); after this many deltas they are merged on disk into one full copy of the rows (0: every checkpoint's rows merged into a full copy).",
    )
    optimizer_thread: bool = setting(
        False,
        "--optimizer-thread",
        "Apply every push on one optimizer thread that the request threads hand pushes to (measured slower on CPU: see docs/BENCHMARKS.md).",
        is_flag=True,
    )
    coalesce: str = setting(
        "off",
        "--coalesce",
        "ssp:K and async: sum the gradients that arrive while the optimizer steps into one step (each still counts once for clocks, batches and the schedule), as a BytePS or ps-lite server does; off: one step a push (see docs/architecture.md).",
        choices=("on", "off"),
    )
    delay_compensation: float | None = setting(
        None,
        "--delay-compensation",
        "ssp:K and async, Adam or AdamW: correct each gradient for the pushes applied since its worker pulled, DC-ASGD's adaptive form: g + C / lr * g * g * (w_now - w_read) / sqrt(v), v Adam's second moment; this is C (0: off). It costs a copy of the shard's parameters a pull. Default: 3 for a model with sparse tables (where one step of staleness cost 0.015 AUC without it), else off. See docs/BENCHMARKS.md.",
        type=float,
    )
    table_rows: int = setting(
        0,
        "--table-rows",
        "Also hold as a sparse table on the servers every trainable nn.Embedding or nn.EmbeddingBag of at least this many rows, built with sparse=True or not (0: only those built with sparse=True).",
    )
    table_optimizer: str = setting(
        "",
        "--table-optimizer",
        "The sparse tables' row optimizers, comma-separated [TABLE=]OPTIMIZER[:LR] (OPTIMIZER: sgd, adagrad, rowwise-adagrad, sparse-adam: torch's SparseAdam, bias-corrected by the table's steps, or adam: lazy, bias-corrected by each row's; no TABLE=: every table not named; LR: the table's own, constant; no LR: --lr and its schedule). Empty: every table follows --optimizer (adam and adamw: sparse-adam; sgd, momentum, nesterov and delayed-nesterov: sgd).",
    )
    skip_nonfinite: bool = setting(
        False,
        "--skip-nonfinite",
        "Skip and count gradients holding NaN or Inf instead of failing the push.",
        is_flag=True,
    )
    security: Security = field(default_factory=Security)
    shard: int = setting(
        0,
        "--shard",
        "I/S: hold the I-th of S equal contiguous ranges of the flat parameters; run one server per shard and give workers every address, in order (--server A,B,...). auto: I is the host name's ordinal (a StatefulSet pod's), S is PARAMSERVER_SHARDS.",
        type=str,
        cli_default="0/1",
        parse=_shard_fields,
        show=lambda c: f"{c.shard}/{c.shards}",
    )
    shards: int = 1  # of the shard above: --shard I/S
    metrics_port: int | None = setting(
        None,
        "--metrics-port",
        "Serve Prometheus metrics on http://METRICS_HOST:PORT/metrics [default: off].",
        type=int,
    )
    metrics_host: str = setting(
        "127.0.0.1",
        "--metrics-host",
        "Address the metrics listen on; 0.0.0.0 opens them to every interface (no token guards them: they show worker names and the loss).",
    )

    @property
    def data_port_number(self) -> int | None:
        """The data port to bind (0: any free one), or None for none.

        Raises:
            ConfigError: --data-port is neither auto, off nor a port.
        """
        if self.data_port == "off":
            return None
        if self.data_port == "auto":
            return self.port + 1 if 0 < self.port < 65535 else 0
        if not self.data_port.isdigit() or not 0 <= int(self.data_port) <= 65535:
            raise ConfigError(
                f"--data-port must be auto, off or a port from 0 to 65535; got {self.data_port!r}."
            )
        return int(self.data_port)

    def __post_init__(self) -> None:
        Policy.parse(self.policy)
        check_count("--workers", self.workers)  # the plan's world size: int32 on the wire
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
        if self.backup_workers:
            _check_backups(self.backup_workers, self.workers, self.parsed_policy, self.shards)
        check_count("--batch-size", self.batch_size)
        check_count("--epochs", self.epochs, 1, MAX_EPOCHS)
        check_count("--seed", self.seed, 0, MAX_SEED)
        self._check_ports()
        check_seconds("--lease-timeout", self.lease_seconds)
        check_count("--table-rows", self.table_rows, 0, MAX_INT64)
        check_count("--checkpoint-delta-every", self.checkpoint_delta_every, 0)
        parse_table_optimizers(self.table_optimizer)
        if self.coalesce not in ("on", "off"):
            raise ConfigError(f"--coalesce must be on or off; got {self.coalesce!r}.")
        self._check_compensation()
        if not 4096 <= self.chunk_bytes <= 16 << 20 or self.chunk_bytes % 4:
            raise ConfigError(
                "--chunk-bytes must be a multiple of 4 from 4096 to 16777216 (16 MiB); got "
                f"{self.chunk_bytes}."
            )
        if self.threads is not None:
            check_count("--server-threads", self.threads, 1, MAX_LOCAL)
        check_seconds("--barrier-timeout", self.barrier_timeout)
        check_server_device(self.server_device)
        if not 0 <= self.shard < self.shards <= MAX_SHARDS:
            raise ConfigError(
                f"--shard must be I/S with 0 <= I < S <= {MAX_SHARDS}; got "
                f"{self.shard}/{self.shards}."
            )
        if self.cuts and parse_every(self.checkpoint_every)[0] is None:
            raise ConfigError(
                "A shard of a sharded run checkpoints every N iterations (sync rounds, or "
                "worker clocks), so that every shard cuts at the same point: give "
                f"--checkpoint-every a number (e.g. 200), not {self.checkpoint_every!r}."
            )

    def compensation(self, tables: bool) -> float:
        """--delay-compensation's C for a model with sparse ``tables`` or none: as given,
        else 3 for tables where it applies (ssp:K or async, Adam or AdamW, a CPU shard)."""
        if self.delay_compensation is not None:
            return self.delay_compensation
        applies = not self.parsed_policy.synchronous and self.optimizer.name in _WITH_SECOND_MOMENT
        return DEFAULT_COMPENSATION if tables and applies and self.server_device == "cpu" else 0.0

    def outer_optimizer(self) -> OptimizerConfig:
        """``optimizer`` with delayed-nesterov's period resolved: as given, else 1 under
        sync (a round averages the workers already) and --workers otherwise."""
        cfg = self.optimizer
        if cfg.name != "delayed-nesterov" or cfg.period:
            return cfg
        return replace(cfg, period=1 if self.parsed_policy.synchronous else self.workers)

    def _check_compensation(self) -> None:
        if self.delay_compensation is None:
            return
        _non_negative("--delay-compensation", self.delay_compensation)
        if not self.delay_compensation:
            return
        why = ""
        if self.parsed_policy.synchronous:
            why = f"--policy {self.policy} has no stale gradients to correct (ssp:K, async)"
        elif self.optimizer.name not in _WITH_SECOND_MOMENT:
            why = f"it scales by Adam's second moment: --optimizer adam or adamw, not {self.optimizer.name}"
        elif self.server_device != "cpu":
            why = f"it runs on a CPU shard, not --server-device {self.server_device}"
        if why:
            raise ConfigError(f"--delay-compensation {self.delay_compensation:g}: {why}.")

    def _check_ports(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be between 0 and 65535; got {self.port}.")
        self.data_port_number  # noqa: B018 - checks --data-port
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"--metrics-port must be between 0 and 65535; got {self.metrics_port}."
            )

    def round_clip(self, tables: bool) -> tuple[float, bool]:
        """``Arrival.clip`` and ``Rounds.relay``: --clip-grad-norm where a step's norm spans
        more than this server's dense part (a shard, a model with sparse ``tables``), and
        whether a sync round's other parts come through a worker (``norm_round.py``; under
        ssp:K and async each push says its norm: ``push_norm``)."""
        clip = self.optimizer.clip if self.shards > 1 or tables else 0.0
        return clip, bool(clip and self.parsed_policy.synchronous and self.shards > 1)

    def push_norm(self, tables: bool) -> bool:
        """Whether each push must say its squared norm over the whole model (JoinResponse)."""
        return bool(self.round_clip(tables)[0]) and not self.parsed_policy.synchronous

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


def _check_backups(backups: int, workers: int, policy: Policy, shards: int) -> None:
    if not 0 <= backups < workers:
        raise ConfigError(
            f"--backup-workers must be at least 0 and below --workers ({workers}); got {backups}."
        )
    if not policy.synchronous:
        raise ConfigError(f"--backup-workers is for --policy sync, not {policy.name}.")
    if shards > 1:
        raise ConfigError(
            "--backup-workers needs one server shard: shards would close their rounds with "
            "different workers' gradients."
        )
