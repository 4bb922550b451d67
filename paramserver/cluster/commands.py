"""The settings of the commands that run training, ``paramserver server | worker | launch``,
as parts of the configs (``paramserver.settings.Part``) in ``--help`` order, and the argv
that starts each of them as a child with a given config. The command line builds its
options from these parts and a child's argv derives from them, so the argv parses back into
the config it came from. Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paramserver.config import LaunchConfig, OptimizerConfig, Security, ServerConfig, WorkerConfig
from paramserver.config.base import MAX_LOCAL, check_count
from paramserver.config.cores import shard_threads
from paramserver.config.devices import shard_device
from paramserver.settings import Part, command_args, setting

# A child's settings are its argv and the variables it inherits, never its parent's
# config file: an empty PARAMSERVER_CONFIG counts as unset.
CHILD_ENV = {"PARAMSERVER_CONFIG": ""}


@dataclass(frozen=True)
class Procs:
    """``worker``'s own setting."""

    procs: int = setting(
        1,
        "--procs",
        "Worker processes to start on this host (one per GPU when there are several): their lines are shown prefixed with their rank ([rank R]; [proc I] before it joined), one line each says how it ended, and the exit status is 1 if any failed; logs rank-R.log in a temporary folder.",
        type=int,
    )

    def __post_init__(self) -> None:
        check_count("--procs", self.procs, 1, MAX_LOCAL)


@dataclass(frozen=True)
class LaunchOutput:
    """``launch``'s own setting."""

    json: bool = setting(
        False,
        "--json",
        "Print one final JSON line (progress goes to stderr).",
        dest="as_json",
        env="LAUNCH_JSON",
        is_flag=True,
    )


@dataclass(frozen=True)
class ServerRun:
    """``server``'s own report (``cluster/server_evaluation.py``): its run folder and where
    its test set is; the same settings as launch's."""

    run_dir: str | None = dataclasses.field(
        default="auto", metadata=LaunchConfig.__dataclass_fields__["run_dir"].metadata
    )
    data_dir: str | None = dataclasses.field(
        default=None, metadata=LaunchConfig.__dataclass_fields__["data_dir"].metadata
    )
    exit_when_done: bool = setting(
        False,
        "--exit-when-done",
        "Exit 0 once the run is over and every worker has left (after the last epoch's evaluation, with a last checkpoint, as SIGTERM would): for launchers that wait for every process (torchx). Exit 1 instead, after the same last checkpoint, if the run's summary.json could not be written within 600 s. A shard that does not hand out batches learns the end from the workers leaving. Without it, a server runs until SIGTERM.",
        is_flag=True,
    )


# A server's own place: where it listens, its threads, its shard and whether the workers it
# resumes with are gone (launch picks them).
LOCAL = (
    "host",
    "port",
    "data_port",
    "threads",
    "server_device",
    "metrics_port",
    "metrics_host",
    "shard",
    "forget_workers",
)
# What `server` and `launch` share: the run and its optimizer.
SCHEDULE = ("schedule", "by")  # a server's default and launch's differ
RUN = (Part(ServerConfig, exclude=LOCAL), Part(OptimizerConfig, exclude=SCHEDULE))
SERVER = (
    *RUN,
    Part(OptimizerConfig, only=SCHEDULE),
    Part(ServerConfig, only=LOCAL),
    Part(ServerRun),
    Part(Security),
)
WORKER = (Part(WorkerConfig), Part(Procs), Part(Security))
LAUNCH = (
    *RUN,
    Part(OptimizerConfig, only=SCHEDULE, defaults={"schedule": "cosine", "by": "batches"}),
    Part(LaunchConfig, exclude=("progress",)),
    Part(ServerConfig, only=("threads", "server_device")),
    Part(LaunchOutput),
    Part(LaunchConfig, only=("progress",)),
)


def servers_own() -> dict[str, str]:
    """The options of the run's plan that ``server`` takes and ``worker`` does not, each
    with the sentence a worker given it says (the server owns the plan)."""
    mine = {option for part in WORKER for _, _, option in part.settings()}
    return {
        option: (
            f"{option} is the server's: the server owns the run's plan (model, data set, "
            f"epochs, batch size, optimizer, policy) and every worker takes it at Join; give "
            f"{option} to `paramserver server` (or `launch`)."
        )
        for part in RUN
        for _, _, option in part.settings()
        if option not in mine
    }


def shard_config(cfg: ServerConfig, shard: int, shards: int, host: str) -> ServerConfig:
    """Shard ``shard`` of the ``shards`` a launch starts, on ``host``: its share of the
    host's cores (``--server-threads``' default: cores/S) and GPUs (``--server-device
    cuda``: GPU i modulo their number); a resumed run's old workers are gone (launch
    knows)."""
    return dataclasses.replace(
        cfg,
        shard=shard,
        shards=shards,
        host=host,
        forget_workers=True,
        threads=shard_threads(cfg.threads, shards),  # they share this host's cores
        server_device=shard_device(cfg.server_device, shard),
    )


def server_args(cfg: ServerConfig) -> list[str]:
    """Command-line arguments that start a server process with ``cfg`` (its token goes by
    the environment, which children inherit). Such a server evaluates nothing: the
    command that starts it does, or needs no evaluation."""
    return ["server", *command_args(SERVER, cfg), "--run-dir", "off"]


def worker_command(cfg: WorkerConfig) -> list[str]:
    """Command-line arguments that start a worker process with ``cfg`` (its token goes by
    the environment)."""
    return ["worker", *command_args(WORKER, cfg)]


def worker_args(cfg: LaunchConfig, address: str, name: str) -> list[str]:
    """Command-line arguments that start one of ``cfg``'s worker processes."""
    return worker_command(cfg.worker(address, name))


def launch_args(cfg: LaunchConfig) -> list[str]:
    """Command-line arguments of ``paramserver launch`` that give ``cfg`` (the benchmarks
    start launches this way); launch's own servers listen on 127.0.0.1, any port."""
    return ["launch", *command_args(LAUNCH, cfg)]
