"""What every config shares: the choices and limits of settings, the optimizer's and the
security settings, and the parsers of ``--shard`` and ``--checkpoint-every``."""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paramserver.errors import ConfigError
from paramserver.settings import setting

DEFAULT_CACHE_ROWS = 1 << 16  # a sparse table's rows on a worker (``sparse/embedding.py``)

# nesterov: DiLoCo's outer step; delayed-nesterov: its form for async (server/bookkeeping/outer)
OPTIMIZERS = ("sgd", "momentum", "nesterov", "delayed-nesterov", "adam", "adamw")
DECAY_ON = ("all", "matrices")  # --weight-decay-on
ROW_OPTIMIZERS = (
    "sgd",
    "adagrad",
    "rowwise-adagrad",
    "adam",
    "sparse-adam",
)  # a sparse table's (sparse/optim)
LR_SCHEDULES = ("constant", "cosine", "linear")
LR_SCHEDULE_BY = ("steps", "batches")
SHM_CHOICES = ("on", "payloads", "off")
WIRE_CHOICES = ("auto", "grpc")  # --wire: the data port when offered, or gRPC streams
AMP_MODES = ("off", "bf16", "fp16")  # --amp (training/precision.py)
INNER_OPTIMIZERS = ("none", "sgd", "adamw")  # --inner-optimizer (training/local_steps.py)
DATASETS = ("fashion-mnist", "synthetic", "clicks")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
# The most batches a worker computes per push (--push-every K); the server enforces it too.
MAX_PUSH_EVERY = 1024
# The largest gRPC message either end sends or takes (a row pull's reply is refused above it).
MAX_MESSAGE_BYTES = 64 << 20
# What a built-in model brings on the command line (``server``, ``launch``) for settings left
# at their defaults: the run that reaches the accuracy docs/RESULTS.md reports. Keys are the
# click parameters' names.
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "resnet": {"epochs": 10, "lr": 2e-3},
    "dlrm": {"dataset": "clicks", "epochs": 2, "batch_size": 256, "lr": 1e-2},
}
MODEL_DEFAULTS["dlrm-sparse"] = MODEL_DEFAULTS["dlrm"]


# The largest value of each kind of numeric setting: what the protocol's fields, the clocks
# and the host carry, far above any real use. A value past them used to be taken and fail
# later, far from its cause (a --workers of 2^31 failed every Join with "Value out of range";
# a --lease-timeout of 1e300 killed the lease reaper). Each check goes through
# ``check_count`` or ``check_seconds``, which name the option, the value and the bound.
MAX_INT32 = 2**31 - 1  # an int32 field: the plan's workers and batch size, a rank
MAX_INT64 = 2**63 - 1  # an int64 field: optimizer steps, clocks, rounds, a table's rows
MAX_EPOCHS = 10**6  # the run's batches, epochs x batches an epoch, are int64 on the wire
# A seed: epochs are ordered by torch's generator seeded with seed * 1_000_003 + epoch,
# which must fit its 64 bits; numpy's generators take no negative seed.
MAX_SEED = 2**32 - 1
MAX_LOCAL = 4096  # threads or processes one command starts on its host
MAX_SHARDS = 4096  # server shards: a process and a file a checkpoint each
# Seconds: ten years, well inside what threading's waits (TIMEOUT_MAX), time.sleep and
# gRPC's deadlines (about 7e9 s from now) take.
MAX_SECONDS = min(10 * 365 * 86400.0, threading.TIMEOUT_MAX)


def check_count(name: str, value: int, least: int = 1, most: int = MAX_INT32) -> None:
    """Raise ConfigError naming ``name``, ``value`` and the bound unless ``least <= value
    <= most``."""
    if not value >= least:
        floor = "zero or more" if least == 0 else f"at least {least}"
        raise ConfigError(f"{name} must be {floor}; got {value!r}.")
    if not value <= most:
        raise ConfigError(f"{name} must be at most {most}; got {value!r}.")


def check_seconds(name: str, value: float, *, zero: bool = False) -> None:
    """Raise ConfigError unless ``value`` is a duration above 0 (with ``zero``, 0 or more)
    and at most ``MAX_SECONDS``."""
    (_non_negative if zero else _positive)(name, value)
    if value > MAX_SECONDS:
        raise ConfigError(
            f"{name} must be at most {MAX_SECONDS:.0f} seconds (ten years); got {value!r}."
        )


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a positive, finite number; got {value!r}.")


def parse_table_optimizers(text: str) -> dict[str, tuple[str, float | None]]:
    """``--table-optimizer``: comma-separated ``[TABLE=]OPTIMIZER[:LR]``, as
    ``{table: (optimizer, lr)}``; the key "" is every table not named, and an lr of None
    the server's --lr and its schedule.

    Raises:
        ConfigError: an entry that names no row optimizer, a learning rate that is not a
            positive number, or a table (or the default) given twice.
    """
    out: dict[str, tuple[str, float | None]] = {}
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        table, _, rest = entry.rpartition("=")
        name, _, rate = rest.partition(":")
        if name not in ROW_OPTIMIZERS:
            raise ConfigError(
                f"--table-optimizer {entry!r}: {name!r} is not a row optimizer; choose one "
                f"of {', '.join(ROW_OPTIMIZERS)} ([TABLE=]OPTIMIZER[:LR], comma-separated)."
            )
        lr = None
        if rate:
            try:
                lr = float(rate)
            except ValueError:
                lr = math.nan
            if not (lr > 0 and math.isfinite(lr)):
                raise ConfigError(
                    f"--table-optimizer {entry!r}: the learning rate must be a positive "
                    f"number; got {rate!r}."
                )
        key = table.strip()
        if key in out:
            raise ConfigError(
                f"--table-optimizer names {'table ' + repr(key) if key else 'the default'} twice."
            )
        out[key] = (name, lr)
    return out


def _non_negative(name: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be zero or more, and finite; got {value!r}.")


@dataclass(frozen=True)
class OptimizerConfig:
    """The server-side optimizer."""

    name: str = setting(
        "adam",
        "--optimizer",
        "Server-side optimizer (nesterov: SGD with Nesterov momentum, DiLoCo's outer optimizer over the workers' local steps, e.g. --lr 0.7; delayed-nesterov: its form for async and ssp:K, each push at --lr/N and the momentum moved once every N pushes, Liu et al. 2024; see docs/guide.md).",
        dest="optimizer",
        choices=OPTIMIZERS,
    )
    lr: float = setting(1e-3, "--lr", "Learning rate.")
    momentum: float = setting(
        0.9, "--momentum", "Momentum (optimizers momentum, nesterov and delayed-nesterov)."
    )
    weight_decay: float = setting(0.0, "--weight-decay", "Weight decay.")
    schedule: str = setting(
        "constant",
        "--lr-schedule",
        "constant, or cosine or linear decay to --lr-floor over --lr-total-steps optimizer steps (after --lr-warmup's, which they include), or module:function: your factory of a torch.optim.lr_scheduler over the optimizer it is given (at --lr), stepped once a server step. The default is constant on server, cosine over the whole run on launch: launch starts the workers, so it can count the run's optimizer steps, which a server cannot (it does not know its workers' --push-every).",
        dest="lr_schedule",
    )
    total_steps: int | None = setting(
        None,
        "--lr-total-steps",
        "Optimizer steps the cosine or linear schedule spans, its warmup included [launch: the whole run].",
        type=int,
        dest="lr_total_steps",
    )
    warmup: int = setting(
        0,
        "--lr-warmup",
        "Optimizer steps of linear warmup before the schedule: step i (from 0) at --lr x (i+1)/N, then the schedule from --lr.",
        dest="lr_warmup",
    )
    floor: float = setting(
        0.0,
        "--lr-floor",
        "The fraction of --lr that cosine and linear decay end at (0.1: 10%), from 0 to 1.",
        dest="lr_floor",
    )
    by: str = setting(
        "steps",
        "--lr-schedule-by",
        "What moves the schedule: steps, the optimizer steps taken; batches, the share of the run's batches done (a server that hands out batches; else steps), at --lr-total-steps for the whole run, so that a run that takes more optimizer steps than planned (rounds short of a worker after a fault) decays over all its batches instead of ending at rate 0. The default is steps on server, batches on launch.",
        choices=LR_SCHEDULE_BY,
        dest="lr_schedule_by",
    )
    period: int = setting(
        0,
        "--nesterov-period",
        "delayed-nesterov: N, the pushes the momentum moves once for [0: the server's --workers; 1 under sync, whose rounds already average the workers].",
        type=int,
        dest="nesterov_period",
    )
    decay_on: str = setting(
        "all",
        "--weight-decay-on",
        "all: --weight-decay on every parameter; matrices: only on those of two or more dimensions that are not an embedding's (none on biases, normalisation layers and embeddings: a transformer's two parameter groups).",
        choices=DECAY_ON,
        dest="weight_decay_on",
    )
    betas: str = setting(
        "0.9,0.999", "--adam-betas", "adam, adamw: beta1,beta2.", dest="adam_betas"
    )
    eps: float = setting(
        1e-8, "--adam-eps", "adam and adamw: the term added to the denominator.", dest="adam_eps"
    )
    clip: float = setting(
        0.0,
        "--clip-grad-norm",
        "Scale the gradient of each optimizer step down to this L2 norm over the whole model when it is larger, as torch.nn.utils.clip_grad_norm_ (0: off). For one server without sparse tables, for now.",
        dest="clip_grad_norm",
    )

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(
                f"Unknown optimizer (--optimizer) {self.name!r}: choose one of {', '.join(OPTIMIZERS)}."
            )
        _positive("The learning rate (--lr)", self.lr)
        _non_negative("--momentum", self.momentum)
        _non_negative("--weight-decay", self.weight_decay)
        _non_negative("--clip-grad-norm", self.clip)
        _positive("--adam-eps", self.eps)
        self.parsed_betas  # noqa: B018 - refused here if it does not parse
        if self.decay_on not in DECAY_ON:
            raise ConfigError(
                f"--weight-decay-on must be one of {', '.join(DECAY_ON)}; got {self.decay_on!r}."
            )
        if self.decay_on != "all" and self.name == "delayed-nesterov":
            raise ConfigError("--weight-decay-on matrices is not for --optimizer delayed-nesterov.")
        check_count("--nesterov-period", self.period, 0)
        if self.period and self.name != "delayed-nesterov":
            raise ConfigError(
                f"--nesterov-period is for --optimizer delayed-nesterov, not {self.name}."
            )
        if self.schedule not in LR_SCHEDULES and ":" not in self.schedule:
            raise ConfigError(
                f"Unknown learning-rate schedule (--lr-schedule) {self.schedule!r}: choose one "
                f"of {', '.join(LR_SCHEDULES)}, or module:function (an lr_scheduler factory)."
            )
        if ":" in self.schedule and (self.warmup or self.floor):
            raise ConfigError("--lr-warmup and --lr-floor shape the built-in schedules only.")
        if self.by not in LR_SCHEDULE_BY:
            raise ConfigError(
                f"--lr-schedule-by must be one of {', '.join(LR_SCHEDULE_BY)}; got {self.by!r}."
            )
        decays = self.schedule in ("cosine", "linear")
        if decays and (self.total_steps is None or self.total_steps < 1):
            raise ConfigError(
                f"--lr-schedule {self.schedule} needs --lr-total-steps, the number of "
                f"optimizer steps it decays over (at least 1); got {self.total_steps!r}."
            )
        if self.total_steps is not None:  # optimizer steps: int64 versions on the wire
            check_count("--lr-total-steps", self.total_steps, 1, MAX_INT64)
        check_count("--lr-warmup", self.warmup, 0, MAX_INT64)
        if decays and self.total_steps is not None and self.warmup >= self.total_steps:
            raise ConfigError(
                f"--lr-warmup {self.warmup} leaves nothing of --lr-total-steps "
                f"{self.total_steps} to decay over: the warmup is part of the total."
            )
        if not 0.0 <= self.floor <= 1.0:
            raise ConfigError(f"--lr-floor is a fraction of --lr, from 0 to 1; got {self.floor}.")

    @property
    def parsed_betas(self) -> tuple[float, float]:
        """``--adam-betas`` as two floats, each from 0 up to (not including) 1."""
        try:
            b1, b2 = (float(b) for b in self.betas.split(","))
        except ValueError:
            raise ConfigError(
                f"--adam-betas must be two numbers, beta1,beta2 (0.9,0.999); got {self.betas!r}."
            ) from None
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"--adam-betas must each be from 0 to below 1; got {self.betas!r}.")
        return b1, b2

    def rate(
        self, step: int, done: tuple[int, int] | None, at: Callable[[int], float] | None = None
    ) -> float:
        """The learning rate (``at`` a step, default ``lr_at``) of optimizer step ``step``; by
        batches, at most that of the step the plan reached (``done``: batches done, the run's;
        None: no plan), so a run of more, smaller steps than planned ends at the plan's last."""
        total, at = self.total_steps, at or self.lr_at  # ``at``: a factory's (server side)
        if self.by != "batches" or done is None or total is None or done[1] < 1:
            return at(step)
        reached = min(done[0] * total // done[1], total - 1)
        return at(min(step, reached))

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based): ``--lr-warmup``'s linear
        rise, then constant, or cosine or linear decay from ``--lr`` to ``--lr-floor`` of it
        at ``--lr-total-steps`` (the warmup counted in), and the floor after."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.schedule not in ("cosine", "linear") or self.total_steps is None:
            return self.lr  # constant (a factory's rates are the server's: ``UserSchedule``)
        span = self.total_steps - self.warmup
        p = min(step - self.warmup, span) / span
        low = self.lr * self.floor
        shape = 0.5 * (1.0 + math.cos(math.pi * p)) if self.schedule == "cosine" else 1 - p
        return low + (self.lr - low) * shape


@dataclass(frozen=True)
class Security:
    """TLS files and the shared token, the same options on servers and workers.

    Server: ``cert``/``key`` serve TLS; with ``ca`` too, clients must present a
    certificate signed by it (mutual TLS). Worker: ``ca`` verifies the server;
    ``cert``/``key`` are the client certificate. ``token``: every call carries it and the
    server refuses calls without it.
    """

    cert: str | None = setting(
        None,
        "--tls-cert",
        "PEM certificate: on server, the server's own; on worker, status and health, this client's (for a server that asks for one: mutual TLS).",
        dest="tls_cert",
    )
    key: str | None = setting(None, "--tls-key", "PEM private key of --tls-cert.", dest="tls_key")
    ca: str | None = setting(
        None,
        "--tls-ca",
        "PEM CA bundle: on the server, clients must present a certificate it signed (mutual TLS); on clients, it verifies the server.",
        dest="tls_ca",
    )
    token: str | None = setting(
        None,
        "--token",
        "Shared secret: the server refuses calls without it (UNAUTHENTICATED). Prefer the variable to the flag, which shows in ps.",
        secret=True,
    )

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
        ConfigError: not two integers with 0 <= I < S, or S above ``MAX_SHARDS``.
    """
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if match is None or not 0 <= int(match[1]) < int(match[2]):
        raise ConfigError(f"--shard must be I/S with 0 <= I < S, e.g. 0/2; got {text!r}.")
    check_count(f"--shard {text.strip()}: S", int(match[2]), 1, MAX_SHARDS)
    return int(match[1]), int(match[2])


def _shard_fields(text: str) -> dict[str, int]:
    index, shards = parse_shard(text)
    return {"shard": index, "shards": shards}


def parse_every(text: str) -> tuple[int | None, float | None]:
    """``--checkpoint-every``: ``N`` optimizer steps or ``Ns`` seconds (also ``Nm``).

    Raises:
        ConfigError: neither form, or past ``MAX_INT64`` steps or ``MAX_SECONDS``.
    """
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(s|m)?\s*$", text or "")
    if m and m.group(2):
        seconds = float(m.group(1)) * (60 if m.group(2) == "m" else 1)
        if seconds > 0:
            check_seconds(f"--checkpoint-every {text.strip()}", seconds)
            return None, seconds
    elif m and "." not in m.group(1) and int(m.group(1)) > 0:
        check_count(f"--checkpoint-every {text.strip()}: N", int(m.group(1)), 1, MAX_INT64)
        return int(m.group(1)), None
    raise ConfigError(
        f"--checkpoint-every must be a number of optimizer steps (500) or of seconds (30s, "
        f"5m), above zero; got {text!r}."
    )
