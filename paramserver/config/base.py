"""What every config shares: the choices and limits of settings, the optimizer's and the
security settings, and the parsers of ``--shard`` and ``--checkpoint-every``."""

from __future__ import annotations

import math
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from paramserver.errors import ConfigError
from paramserver.settings import setting

DEFAULT_CACHE_ROWS = 1 << 16  # a sparse table's rows on a worker (``sparse/embedding.py``)

# nesterov: DiLoCo's outer step; delayed-nesterov: its form for async (server/optim/outer)
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
DATASETS = ("fashion-mnist", "synthetic", "clicks", "text")
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
# a byte-level GPT on this Python's standard library (training/text.py): one epoch is
# about 15,000 samples of 64 bytes
MODEL_DEFAULTS["gpt-tiny"] = {"dataset": "text", "epochs": 1, "batch_size": 32}


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
