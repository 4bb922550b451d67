"""Every numeric setting has an upper bound that the protocol's fields and the clocks carry
(``config/base.py``: ``check_count``, ``check_seconds``): the bound itself is taken, one
past it is refused with a sentence naming the option, the value and the bound. The
command line, the variables and a config file build these same dataclasses."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest

from paramserver import settings
from paramserver.cli import flags
from paramserver.cluster.commands import Procs
from paramserver.config import (
    MAX_PUSH_EVERY,
    LaunchConfig,
    OptimizerConfig,
    ServerConfig,
    WorkerConfig,
    parse_every,
    parse_shard,
)
from paramserver.errors import ConfigError

# The bounds, as the contract states them (``config/base.py`` holds them once).
MAX_INT32 = 2**31 - 1  # an int32 field of the wire
MAX_INT64 = 2**63 - 1  # an int64 field
MAX_EPOCHS = 10**6  # epochs x batches an epoch: int64 batch numbers
MAX_SEED = 2**32 - 1
MAX_LOCAL = 4096  # threads or processes on one host
MAX_SHARDS = 4096
TEN_YEARS = 10 * 365 * 86400
MAX_SECONDS = float(TEN_YEARS)

MAKERS: dict[type, Callable[..., Any]] = {
    ServerConfig: ServerConfig,
    OptimizerConfig: OptimizerConfig,
    WorkerConfig: lambda **kw: WorkerConfig(server="127.0.0.1:1", **kw),
    LaunchConfig: lambda **kw: LaunchConfig(server=ServerConfig(), **kw),
    Procs: Procs,
    flags.Status: flags.Status,
    flags.Health: flags.Health,
    flags.Export: lambda **kw: flags.Export(model="mlp", **kw),
    flags.Reshard: lambda **kw: flags.Reshard(model="mlp", **{"shards": 1, **kw}),
    flags.Chaos: flags.Chaos,
}

# (config, field, its option, the largest value taken, the least refused above it); None:
# no upper bound (a double on the wire carries any finite number; the command line refuses
# inf and nan, and so does the config).
SECONDS = (MAX_SECONDS, MAX_SECONDS * 1.5)
BOUNDS: list[tuple[type, str, str, Any, Any]] = [
    (ServerConfig, "workers", "--workers", MAX_INT32, MAX_INT32 + 1),
    (ServerConfig, "batch_size", "--batch-size", MAX_INT32, MAX_INT32 + 1),
    (ServerConfig, "epochs", "--epochs", MAX_EPOCHS, MAX_EPOCHS + 1),
    (ServerConfig, "seed", "--seed", MAX_SEED, MAX_SEED + 1),
    (ServerConfig, "port", "--port", 65535, 65536),
    (ServerConfig, "lease_seconds", "--lease-timeout", *SECONDS),
    (ServerConfig, "chunk_bytes", "--chunk-bytes", 16 << 20, (16 << 20) + 4),
    (ServerConfig, "threads", "--server-threads", MAX_LOCAL, MAX_LOCAL + 1),
    (ServerConfig, "barrier_timeout", "--barrier-timeout", *SECONDS),
    (ServerConfig, "min_workers", "--min-workers", 1, 2),  # at most --workers
    (ServerConfig, "backup_workers", "--backup-workers", 1, 2),  # below --workers
    (ServerConfig, "checkpoint_delta_every", "--checkpoint-delta-every", MAX_INT32, MAX_INT32 + 1),
    (ServerConfig, "delay_compensation", "--delay-compensation", None, math.inf),
    (ServerConfig, "table_rows", "--table-rows", MAX_INT64, MAX_INT64 + 1),
    (ServerConfig, "shards", "--shard", MAX_SHARDS, MAX_SHARDS + 1),
    (ServerConfig, "metrics_port", "--metrics-port", 65535, 65536),
    (OptimizerConfig, "lr", "--lr", None, math.inf),
    (OptimizerConfig, "momentum", "--momentum", None, math.inf),
    (OptimizerConfig, "weight_decay", "--weight-decay", None, math.inf),
    (OptimizerConfig, "total_steps", "--lr-total-steps", MAX_INT64, MAX_INT64 + 1),
    (OptimizerConfig, "period", "--nesterov-period", MAX_INT32, MAX_INT32 + 1),
    (OptimizerConfig, "warmup", "--lr-warmup", MAX_INT64, MAX_INT64 + 1),
    (OptimizerConfig, "floor", "--lr-floor", 1.0, 1.5),
    (OptimizerConfig, "clip", "--clip-grad-norm", None, math.inf),
    (OptimizerConfig, "eps", "--adam-eps", None, math.inf),
    (WorkerConfig, "threads", "--threads", MAX_LOCAL, MAX_LOCAL + 1),
    (WorkerConfig, "rpc_timeout", "--rpc-timeout", *SECONDS),
    (WorkerConfig, "barrier_timeout", "--barrier-timeout", *SECONDS),
    (WorkerConfig, "max_steps", "--max-steps", MAX_INT64, MAX_INT64 + 1),
    (WorkerConfig, "step_delay", "--step-delay", *SECONDS),
    (WorkerConfig, "push_every", "--push-every", MAX_PUSH_EVERY, MAX_PUSH_EVERY + 1),
    (WorkerConfig, "cache_rows", "--cache-rows", MAX_INT32, MAX_INT32 + 1),
    (WorkerConfig, "inner_lr", "--inner-lr", None, math.inf),
    (WorkerConfig, "server_timeout", "--server-timeout", *SECONDS),
    (LaunchConfig, "threads", "--threads", MAX_LOCAL, MAX_LOCAL + 1),
    (LaunchConfig, "step_delay", "--step-delay", *SECONDS),
    (LaunchConfig, "startup_timeout", "--startup-timeout", *SECONDS),
    (LaunchConfig, "push_every", "--push-every", MAX_PUSH_EVERY, MAX_PUSH_EVERY + 1),
    (LaunchConfig, "cache_rows", "--cache-rows", MAX_INT32, MAX_INT32 + 1),
    (LaunchConfig, "inner_lr", "--inner-lr", None, math.inf),
    (LaunchConfig, "servers", "--servers", 64, 65),
    (Procs, "procs", "--procs", MAX_LOCAL, MAX_LOCAL + 1),
    (flags.Status, "watch", "--watch", *SECONDS),
    (flags.Status, "timeout", "--rpc-timeout", *SECONDS),
    (flags.Health, "timeout", "--rpc-timeout", *SECONDS),
    (flags.Export, "seed", "--seed", MAX_SEED, MAX_SEED + 1),
    (flags.Export, "round", "--round", MAX_INT64, MAX_INT64 + 1),
    (flags.Reshard, "shards", "--shards", MAX_SHARDS, MAX_SHARDS + 1),
    (flags.Reshard, "seed", "--seed", MAX_SEED, MAX_SEED + 1),
    (flags.Reshard, "round", "--round", MAX_INT64, MAX_INT64 + 1),
    (flags.Chaos, "faults", "--faults", MAX_INT32, MAX_INT32 + 1),
    (flags.Chaos, "seed", "--seed", MAX_SEED, MAX_SEED + 1),
    (flags.Chaos, "lease", "--lease-timeout", *SECONDS),
    (flags.Chaos, "recover_within", "--recover-within", *SECONDS),
    (flags.Chaos, "local_steps", "--local-steps", MAX_PUSH_EVERY, MAX_PUSH_EVERY + 1),
    (flags.Chaos, "clip", "--clip-grad-norm", None, math.inf),
]
# What a field needs beside it to be checked at all.
WITH = {
    (OptimizerConfig, "period"): {"name": "delayed-nesterov"},
    (OptimizerConfig, "total_steps"): {"schedule": "cosine"},
    (ServerConfig, "backup_workers"): {"policy": "sync", "workers": 2},
}
# A bound that is another setting, as the refusal says it.
SAID = {
    (ServerConfig, "min_workers"): "--workers (1)",
    (ServerConfig, "backup_workers"): "--workers (2)",
}


def _id(row: tuple[type, str, str, Any, Any]) -> str:
    return f"{row[0].__name__}.{row[1]}"


@pytest.mark.parametrize(
    ("cls", "name", "option", "most", "over"), BOUNDS, ids=[_id(r) for r in BOUNDS]
)
def test_the_bound_is_taken_and_past_it_is_refused_naming_option_value_and_bound(
    cls, name, option, most, over
):
    make = MAKERS[cls]
    extra = WITH.get((cls, name), {})
    if most is not None:
        assert getattr(make(**extra, **{name: most}), name) == most
    with pytest.raises(ConfigError) as info:
        make(**extra, **{name: over})
    message = str(info.value)
    assert option in message and "\n" not in message, message
    if most is not None:
        assert repr(over) in message or str(over) in message, message
        bound = f"{most:.0f}" if isinstance(most, float) else str(most)
        assert SAID.get((cls, name), bound) in message, message


def _numeric(cls: type) -> set[str]:
    """The fields of ``cls`` that hold a number (bool is not one)."""
    return {
        f.name
        for f in dataclasses.fields(cls)
        if str(f.type).replace(" | None", "") in ("int", "float")
        and f.name not in ("shard",)  # --shard I/S: its S is the row of ``shards``
    }


@pytest.mark.parametrize("cls", list(MAKERS), ids=lambda c: c.__name__)
def test_every_numeric_setting_has_a_row(cls):
    rows = {name for c, name, *_ in BOUNDS if c is cls}
    assert _numeric(cls) <= rows, f"no bound tested for {sorted(_numeric(cls) - rows)}"
    assert rows <= _numeric(cls)


def test_every_option_of_every_command_that_takes_a_number_is_a_setting_with_a_row():
    from click.types import FloatParamType, IntParamType

    from paramserver.cli.main import cli

    def commands(group: Any) -> list[Any]:
        out = []
        for command in group.commands.values():
            out += commands(command) if hasattr(command, "commands") else [command]
        return out

    numeric = {
        p.opts[0]
        for command in commands(cli)
        for p in command.params
        if isinstance(p.type, (IntParamType, FloatParamType)) and not p.is_flag
    }
    assert "--workers" in numeric and "--shards" in numeric  # every command was seen
    of_these = {flag.flag for cls in MAKERS for _, flag in settings.declared(cls)}
    assert numeric <= of_these, f"settings of no class here: {numeric - of_these}"
    tested = {option for _cls, _name, option, _most, _over in BOUNDS}
    assert numeric <= tested, f"an option that takes a number is untested: {numeric - tested}"


@pytest.mark.parametrize("shards", [MAX_SHARDS + 1, 10**20])
def test_the_shard_count_of_shard_i_s_is_bounded(shards):
    assert parse_shard(f"3/{MAX_SHARDS}") == (3, MAX_SHARDS)
    with pytest.raises(ConfigError) as info:
        parse_shard(f"3/{shards}")
    message = str(info.value)
    assert f"--shard 3/{shards}" in message and f"at most {MAX_SHARDS}" in message


@pytest.mark.parametrize(
    ("text", "parsed", "refused"),
    [
        (str(MAX_INT64), (MAX_INT64, None), str(MAX_INT64 + 1)),
        (f"{TEN_YEARS}s", (None, float(TEN_YEARS)), f"{TEN_YEARS + 1}s"),
        (f"{TEN_YEARS // 60}m", (None, float(TEN_YEARS // 60 * 60)), f"{TEN_YEARS}m"),
    ],
)
def test_checkpoint_every_is_bounded(text, parsed, refused):
    assert parse_every(text) == parsed
    with pytest.raises(ConfigError, match="--checkpoint-every") as info:
        ServerConfig(checkpoint_every=refused)
    assert refused in str(info.value) and "at most" in str(info.value)


def test_a_seed_below_zero_is_refused():
    with pytest.raises(ConfigError, match=r"--seed must be zero or more; got -1\."):
        ServerConfig(seed=-1)


def test_the_code_holds_the_same_bounds_and_threading_waits_the_longest():
    import threading

    from paramserver.config import base

    assert (base.MAX_INT32, base.MAX_INT64, base.MAX_EPOCHS, base.MAX_SEED) == (
        MAX_INT32,
        MAX_INT64,
        MAX_EPOCHS,
        MAX_SEED,
    )
    assert (base.MAX_LOCAL, base.MAX_SHARDS, base.MAX_SECONDS) == (
        MAX_LOCAL,
        MAX_SHARDS,
        MAX_SECONDS,
    )
    assert MAX_SECONDS <= threading.TIMEOUT_MAX


@pytest.mark.parametrize(
    "name", ["rpc_timeout", "barrier_timeout", "connect_timeout", "server_timeout"]
)
def test_a_python_workers_timeouts_are_bounded_as_the_options_are(name):
    """Issue 55's review: ``ps.Worker``'s keyword arguments skipped the options' bounds."""
    from torch import nn

    import paramserver as ps

    with pytest.raises(ConfigError, match=f"{name} must be at most 315360000 seconds"):
        ps.Worker("127.0.0.1:1", nn.Linear(1, 1), **{name: 1e300})  # before it connects
