"""The settings that only the command line has (no config of the API holds them), declared
as the configs' are (``paramserver.settings.setting``): ``--log-level``, the config file's
two options, and what ``status``, ``health``, ``plot``, ``export`` and ``bench`` take.
(``worker --procs`` and ``launch --json`` are with their commands' parts, in
``cluster/commands.py``.) Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from paramserver.config.base import (
    MAX_INT32,
    MAX_INT64,
    MAX_PUSH_EVERY,
    MAX_SEED,
    MAX_SHARDS,
    _non_negative,
    check_count,
    check_seconds,
)
from paramserver.errors import ConfigError
from paramserver.settings import REQUIRED, setting

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class Logging:
    """The group's setting, before the command: ``paramserver --log-level debug server``
    (in a config file: a key before the first table)."""

    log_level: str = setting("info", "--log-level", "Log level.", choices=LOG_LEVELS)


@dataclass(frozen=True)
class ConfigFile:
    """Every command's two last options."""

    config: str | None = setting(
        None,
        "--config",
        'TOML file of settings: a table per command ([server], [worker], ...) whose keys are the options\' names (lr = 0.01, checkpoint-dir = "/ckpt"). The command line and the variables win over it.',
        type=click.Path(exists=True, dir_okay=False),
    )
    print_config: bool = setting(
        False,
        "--print-config",
        "Print the settings as resolved, as a config file that says where each came from (command line, env, file, default), and exit without starting anything.",
        is_flag=True,
    )


@dataclass(frozen=True)
class Query:
    """The server that ``status`` and ``health`` ask: the worker's ``--server`` setting (one
    variable, PARAMSERVER_SERVER, for both), of which they ask the first address."""

    server: str = setting(
        "127.0.0.1:50051",
        "--server",
        "The server's HOST:PORT, or every shard's comma-separated as a worker takes them (the same PARAMSERVER_SERVER): the first, shard 0, is asked.",
        dest="server_address",
    )

    def __post_init__(self) -> None:
        if not self.address:
            raise ConfigError(f"--server needs a HOST:PORT; got {self.server!r}.")

    @property
    def address(self) -> str:
        """The address asked: the first of those given."""
        return self.server.split(",")[0].strip()


@dataclass(frozen=True)
class Status:
    json: bool = setting(
        False,
        "--json",
        "Print the status as one JSON line.",
        dest="as_json",
        env="STATUS_JSON",
        is_flag=True,
    )
    watch: float | None = setting(
        None, "--watch", "Redraw every this many seconds until Ctrl-C.", type=float
    )
    timeout: float = setting(
        5.0,
        "--rpc-timeout",
        "Seconds to wait for the server (5: a person waits for the answer; a worker's calls, which carry payloads, wait 60).",
        env="STATUS_RPC_TIMEOUT",
    )

    def __post_init__(self) -> None:
        if self.watch is not None:
            check_seconds("--watch", self.watch)
        check_seconds("--rpc-timeout", self.timeout)


@dataclass(frozen=True)
class Health:
    timeout: float = setting(
        5.0,
        "--rpc-timeout",
        "Seconds to wait for an answer (5: a healthcheck's or a person's; a worker's calls, which carry payloads, wait 60).",
        env="HEALTH_RPC_TIMEOUT",
    )
    service: str = setting(
        "paramserver.v1.ParameterServer",
        "--service",
        "The service to ask about: paramserver.v1.Checkpoints is NOT_SERVING while checkpoint writes fail.",
        env="HEALTH_SERVICE",
    )

    def __post_init__(self) -> None:
        check_seconds("--rpc-timeout", self.timeout)


@dataclass(frozen=True)
class Plot:
    out: str | None = setting(
        None, "--out", "PNG to write [default: RUN_DIR/curve.png].", env="PLOT_OUT"
    )


@dataclass(frozen=True)
class Export:
    model: str = setting(REQUIRED, "--model", "The run's --model.", required=True)
    seed: int = setting(0, "--seed", "The run's --seed (frozen parameters).")
    round: int | None = setting(
        None,
        "--round",
        "Export the cuts of this round [default: the last checkpoints, if they agree].",
        dest="round_",
        env="EXPORT_ROUND",
        type=int,
    )
    out: str = setting("model.pt", "--out", "Checkpoint to write.", env="EXPORT_OUT")
    snapshot: str | None = setting(
        None,
        "--snapshot",
        "Write a serving snapshot into this new folder instead (tables row by row, "
        "checksummed; paramserver.serving.load reads it).",
        env="EXPORT_SNAPSHOT",
    )
    base: str = setting(
        "",
        "--base",
        "With --snapshot: write a delta of this chain of snapshots, comma-separated (the "
        "full one, then its deltas in order): only the rows changed since, and those gone.",
        env="EXPORT_BASE",
    )

    def __post_init__(self) -> None:
        _check_run(self.seed, self.round)


@dataclass(frozen=True)
class Reshard:
    model: str = setting(REQUIRED, "--model", "The run's --model.", required=True)
    shards: int = setting(
        REQUIRED,
        "--shards",
        "The shard count to write the checkpoints for.",
        type=int,
        required=True,
    )
    seed: int = setting(0, "--seed", "The run's --seed (frozen parameters).")
    out: str | None = setting(
        None,
        "--out",
        "A new folder to write them into [default: CHECKPOINT_DIR, beside the old ones].",
        env="RESHARD_OUT",
    )
    round: int | None = setting(
        None,
        "--round",
        "Re-partition the cuts of this round [default: the last checkpoints, if they agree].",
        dest="round_",
        env="RESHARD_ROUND",
        type=int,
    )

    def __post_init__(self) -> None:
        check_count("--shards", self.shards, 1, MAX_SHARDS)
        _check_run(self.seed, self.round)


def _check_run(seed: int, round_: int | None) -> None:
    """The --seed and --round of the run whose checkpoints are read."""
    check_count("--seed", seed, 0, MAX_SEED)
    if round_ is not None:
        check_count("--round", round_, 0, MAX_INT64)


@dataclass(frozen=True)
class Chaos:
    faults: int = setting(30, "--faults", "Faults to inject, one at a time.", env="CHAOS_FAULTS")
    seed: int = setting(0, "--seed", "Seeds the schedule (kinds, targets) and the run.")
    policy: str = setting(
        "sync", "--policy", "The run's policy: sync, delay-1, ssp:K or async.", env="CHAOS_POLICY"
    )
    kinds: str = setting(
        "all",
        "--kinds",
        "Fault kinds, comma-separated: kill-worker, stop-worker, kill-shard, kill-all-shards, stop-shard, disk-full, link-down (needs network namespaces: root and iproute2; all leaves it out where they cannot be made); all; or server (the server-side ones).",
        env="CHAOS_KINDS",
    )
    lease: float = setting(
        3.0,
        "--lease-timeout",
        "The servers' --lease-timeout, in seconds.",
        env="CHAOS_LEASE_TIMEOUT",
    )
    recover_within: float = setting(
        60.0,
        "--recover-within",
        "Seconds each recovery may take before the run fails the no-hang check.",
        env="CHAOS_RECOVER_WITHIN",
    )
    workdir: str | None = setting(
        None,
        "--workdir",
        "A new or empty folder for the runs' logs and checkpoints [default: a new temporary one].",
        env="CHAOS_WORKDIR",
    )
    local_steps: int = setting(
        0,
        "--local-steps",
        "H > 0: the workers take H local AdamW steps and push their pseudo-gradient (--push-every H --inner-optimizer adamw), the shards apply Nesterov's outer step (DiLoCo), and the model's table is dense; 0: gradients.",
        env="CHAOS_LOCAL_STEPS",
    )
    overlap: str = setting(
        "off",
        "--overlap",
        "With --local-steps: on puts each exchange behind the next H local steps (the workers' --overlap on), off waits for it.",
        choices=("on", "off"),
        env="CHAOS_OVERLAP",
    )
    clip: float = setting(
        0.0,
        "--clip-grad-norm",
        "The servers' --clip-grad-norm: each sync round's gradient clipped by its norm over both shards and the table's rows, relayed by the workers (0: off).",
        env="CHAOS_CLIP_GRAD_NORM",
    )
    json: bool = setting(
        False,
        "--json",
        "Print one JSON line: the schedule, recoveries and checks.",
        dest="as_json",
        env="CHAOS_JSON",
        is_flag=True,
    )

    def __post_init__(self) -> None:
        check_count("--faults", self.faults, 0, MAX_INT32)
        check_count("--seed", self.seed, 0, MAX_SEED)
        check_seconds("--lease-timeout", self.lease)
        check_seconds("--recover-within", self.recover_within)
        check_count("--local-steps", self.local_steps, 0, MAX_PUSH_EVERY)  # --push-every H
        _non_negative("--clip-grad-norm", self.clip)


@dataclass(frozen=True)
class Bench:
    json: bool = setting(
        False,
        "--json",
        "Print one JSON line of figures and ratios.",
        dest="as_json",
        env="BENCH_JSON",
        is_flag=True,
    )
    quick: bool = setting(
        False, "--quick", "A few seconds' version (CI runs it).", env="BENCH_QUICK", is_flag=True
    )
    rate: str = setting(
        "",
        "--rate",
        "network only: the link rates, comma-separated in tc's units (100mbit,1gbit,10gbit) [default: those three; --quick: 1gbit]; training runs at the slowest.",
        env="BENCH_RATE",
    )
    only: str = setting(
        "",
        "--only",
        "sparse: run this case alone; criteo: the Criteo-like recommender case (h)-(k); main: the 1M-row DLRM's tables under async, sync and delay-1 against one local process and DDP, and the CPU a step (a), (c), (d). network: only these training variants beside DDP, comma-separated (fp32, fp32_2shards, bf16, topk, topk_2shards, local32_int8, local32_int8_async, local32, local32_overlap, local32_int8_overlap), and no link figures [default: every case].",
        env="BENCH_ONLY",
    )
    device: str = setting(
        "auto",
        "--device",
        "step and scaling only: where the model computes: auto (cuda when torch sees a GPU, else cpu), cpu, or cuda (the CUDA cases: the MLP at batch 64 and 256, the ResNet at 256, the 20M-parameter mlp-20m at 1024, against a local step and one local process on the same GPU).",
        env="BENCH_DEVICE",
        choices=("auto", "cpu", "cuda"),
    )
