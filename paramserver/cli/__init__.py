"""Command line: ``paramserver server | worker | launch | status | health | plot | export |
bench``, and the status view (``statusview``).

Every option can also be set through the ``PARAMSERVER_*`` variable shown in its help.

May import: every package (it is the top of the layering); nothing imports it but
``__main__``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import click

from paramserver import settings
from paramserver.cluster import roles
from paramserver.config import (
    MODEL_DEFAULTS,
    LaunchConfig,
    OptimizerConfig,
    Security,
    ServerConfig,
    WorkerConfig,
    parse_shard,
)
from paramserver.errors import ConfigError, DataUnavailable, ParamServerError

log = logging.getLogger("paramserver")
F = Callable[..., Any]


def opt(*decls: str, env: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option bound to the environment variable PARAMSERVER_<env>."""
    return click.option(
        *decls, envvar=f"PARAMSERVER_{env}", show_envvar=True, show_default=True, **kwargs
    )


def security_config(kw: dict[str, Any]) -> Security:
    return Security(**settings.values(Security, kw))


def fill_defaults(kw: dict[str, Any], values: dict[str, Any]) -> None:
    """Set in ``kw`` each of ``values`` (by click parameter name) that the command line and
    its environment variable left at its default."""
    ctx = click.get_current_context()
    for name, value in values.items():
        if ctx.get_parameter_source(name) is click.core.ParameterSource.DEFAULT:
            kw[name] = value


def model_defaults(kw: dict[str, Any]) -> None:
    """What the model's ``MODEL_DEFAULTS`` say, where the command line left it unset."""
    fill_defaults(kw, MODEL_DEFAULTS.get(kw["model"], {}))


def server_config(kw: dict[str, Any], **fixed: Any) -> ServerConfig:
    """The ServerConfig that the server options in ``kw`` give (taken out of ``kw``)."""
    optimizer = OptimizerConfig(**settings.values(OptimizerConfig, kw))
    return ServerConfig(
        optimizer=optimizer,
        security=security_config(kw),
        **settings.values(ServerConfig, kw, exclude=tuple(fixed)),
        **fixed,
    )


# The options of a server's run: what `server` and `launch` share.
RUN_OPTIONS = (
    settings.options(
        ServerConfig, exclude=("host", "port", "threads", "metrics_port", "metrics_host")
    ),
    settings.options(OptimizerConfig, exclude=("schedule",)),
)
SECURITY_OPTIONS = settings.options(Security)


def apply(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    def decorate(func: F) -> F:
        for d in reversed(decorators):
            func = d(func)
        return func

    return decorate


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@opt(
    "--log-level",
    env="LOG_LEVEL",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    help="Log level.",
)
@click.version_option(package_name="paramserver")
def cli(log_level: str) -> None:
    """An asynchronous parameter server for data-parallel PyTorch training."""
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def lr_schedule_option(default: str) -> Callable[[F], F]:
    return settings.options(
        OptimizerConfig, exclude=("name", "lr", "momentum", "weight_decay", "total_steps"),
        defaults={"schedule": default},
    )  # fmt: skip


@cli.command()
@apply(*RUN_OPTIONS)
@lr_schedule_option("constant")
@settings.options(ServerConfig, exclude=tuple(
    f.name for f, _ in settings.declared(ServerConfig)
    if f.name not in ("host", "port", "threads", "metrics_port", "metrics_host")
))  # fmt: skip
@opt(
    "--shard",
    env="SHARD",
    default="0/1",
    help="I/S: hold the I-th of S equal contiguous ranges of the flat parameters; run one "
    "server per shard and give workers every address, in order (--server A,B,...). auto: I "
    "is the host name's ordinal (a StatefulSet pod's), S is PARAMSERVER_SHARDS.",
)
@apply(SECURITY_OPTIONS)
def server(shard: str, **kw: Any) -> None:
    """Run a parameter server until SIGTERM or Ctrl-C (both write a last checkpoint).

    Under a TF_CONFIG (Kubeflow TFJob, Volcano) a "ps" task takes its shard, port and the
    number of workers from it, unless given.
    """
    from paramserver.cluster.procs import READY_MARKER
    from paramserver.server.app import ServerApp

    task = roles.tf_config(os.environ)
    if task is not None:
        kw["shard"] = shard
        fill_defaults(kw, roles.server_settings(task))
        shard = kw.pop("shard")
    if shard.strip() == "auto":
        shard = roles.auto_shard(socket.gethostname(), os.environ)
    index, shards = parse_shard(shard)
    model_defaults(kw)
    cfg = server_config(kw, shard=index, shards=shards)
    log.info("server configuration: %s", cfg)
    app = ServerApp(cfg).start()
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    click.echo(f"{READY_MARKER} {app.address}", nl=True)
    sys.stdout.flush()
    stop.wait()
    log.info("%s received: stopping", signal.Signals(received[0]).name)
    app.stop(grace=2.0)


@cli.command()
@opt(
    "--server",
    "server_address",
    env="SERVER",
    help="The server's HOST:PORT; for sharded servers every shard's, in shard order: A,B,... "
    "[default: from TF_CONFIG's cluster.ps]",
)
@settings.options(WorkerConfig)
@opt(
    "--procs",
    env="PROCS",
    type=int,
    default=1,
    help="Worker processes to start on this host (one per GPU when there are several).",
)
@apply(SECURITY_OPTIONS)
def worker(server_address: str | None, procs: int, **kw: Any) -> None:
    """Join a server and train on the batches it hands out until the run is finished.

    Under a TF_CONFIG (Kubeflow TFJob, Volcano) a "worker" or "chief" task dials the ps
    tasks, unless --server is given.
    """
    task = roles.tf_config(os.environ)
    if task is not None:
        kw["server_address"] = server_address
        fill_defaults(kw, roles.worker_settings(task))
        server_address = kw.pop("server_address")
    if not server_address:
        raise ConfigError(
            "Give the server's address: --server HOST:PORT (or PARAMSERVER_SERVER, or a "
            "TF_CONFIG that lists the ps tasks)."
        )
    sec = security_config(kw)
    cfg = WorkerConfig(server=server_address, security=sec, **settings.values(WorkerConfig, kw))
    if procs < 1:
        raise ConfigError(f"--procs must be at least 1; got {procs}.")
    if procs > 1:
        from paramserver.cluster.launch import run_worker_procs

        sys.exit(run_worker_procs(cfg, procs))
    from paramserver.training.trainer import run

    log.info("worker configuration: %s", cfg)
    summary = run(cfg)
    click.echo(json.dumps(summary.__dict__))


@cli.command()
@apply(*RUN_OPTIONS)
@lr_schedule_option("cosine")
@settings.options(LaunchConfig)
@settings.options(ServerConfig, exclude=tuple(
    f.name for f, _ in settings.declared(ServerConfig) if f.name != "threads"
), rename={"threads": "--server-threads"}, defaults={"threads": 1})  # fmt: skip
@opt(
    "--json",
    "as_json",
    env="JSON",
    is_flag=True,
    help="Print one final JSON line (progress goes to stderr).",
)
@opt(
    "--progress/--no-progress", env="PROGRESS", default=True, help="Show a progress bar on stderr."
)
def launch(as_json: bool, progress: bool, **kw: Any) -> None:
    """Train on a local cluster: one server and --workers worker processes.

    The learning rate follows a cosine decay over the whole run unless --lr-schedule constant.

    Evaluates the global model on the test set after every epoch and writes a run folder
    (config.json, metrics.jsonl, curve.png, checkpoint.pt, summary.json, logs).
    """
    from paramserver.cluster.launch import launch as run_launch
    from paramserver.cluster.launch import planned_optimizer_steps
    from paramserver.training import data

    model_defaults(kw)
    launch_kw = settings.values(LaunchConfig, kw)
    if kw["lr_schedule"] == "cosine" and kw["lr_total_steps"] is None:
        # The schedule spans the whole run, which launch can work out from the plan.
        plan = server_config({**kw, "lr_schedule": "constant"}, host="127.0.0.1", port=0)
        kw["lr_total_steps"] = planned_optimizer_steps(
            plan, data.train_size(kw["dataset"], launch_kw["data_dir"]), launch_kw["push_every"]
        )
    cfg = LaunchConfig(
        server=server_config(kw, host="127.0.0.1", port=0), progress=progress, **launch_kw
    )
    summary = run_launch(cfg)
    line = json.dumps(summary)
    if as_json:
        click.echo(line)
    else:
        click.echo(
            f"{summary['policy']}, {summary['workers']} workers, {summary['epochs']} epochs: "
            f"test accuracy {100 * summary['test_accuracy']:.2f}%, "
            + (f"test AUC {summary['test_auc']:.4f}, " if "test_auc" in summary else "")
            + f"{summary['samples_per_s']:.0f} samples/s, wall {summary['wall_s']:.1f}s, "
            f"max staleness {summary['max_staleness']}; run folder {summary['run_dir']}"
        )
    if summary["failed_workers"]:
        raise ParamServerError(
            f"Workers failed: {', '.join(summary['failed_workers'])}; see their logs in {summary['run_dir']}."
        )


# The server that `status` and `health` ask.
QUERY_SERVER_OPTION = opt(
    "--server", "server_address", env="SERVER", default="127.0.0.1:50051",
    help="The server's HOST:PORT.",
)  # fmt: skip


def _status_stub(server_address: str, timeout: float, kw: dict[str, Any]) -> Any:
    from paramserver.transport.stub import Stub, connect

    channel = connect(server_address, timeout, security_config(kw))
    return channel, Stub(channel)


@cli.command()
@QUERY_SERVER_OPTION
@opt("--json", "as_json", env="JSON", is_flag=True, help="Print the status as one JSON line.")
@opt(
    "--watch",
    env="WATCH",
    type=float,
    default=None,
    help="Redraw every this many seconds until Ctrl-C.",
)
@opt("--timeout", env="TIMEOUT", type=float, default=5.0, help="Seconds to wait for the server.")
@apply(SECURITY_OPTIONS)
def status(
    server_address: str, as_json: bool, watch: float | None, timeout: float, **kw: Any
) -> None:
    """Show a server's version, policy, throughput and live workers (clock, lag, samples/s)."""
    import grpc

    from paramserver._proto import paramserver_pb2 as pb
    from paramserver.cli.statusview import as_json as to_json
    from paramserver.cli.statusview import render
    from paramserver.errors import from_rpc_error

    if watch is not None and watch <= 0:
        raise ConfigError(f"--watch must be positive; got {watch}.")
    channel, stub = _status_stub(server_address, timeout, kw)
    try:
        while True:
            try:
                st = stub.Status(pb.StatusRequest(), timeout=timeout)
            except grpc.RpcError as err:
                raise from_rpc_error(err, f"status of {server_address}") from None
            if as_json:
                click.echo(to_json(st))
            else:
                if watch is not None:
                    click.clear()
                click.echo(render(st, server_address))
            if watch is None:
                return
            time.sleep(watch)  # the refresh period the operator asked for
    finally:
        channel.close()


@cli.command()
@QUERY_SERVER_OPTION
@opt("--timeout", env="TIMEOUT", type=float, default=5.0, help="Seconds to wait for an answer.")
@opt("--service", env="HEALTH_SERVICE", default="paramserver.v1.ParameterServer",
     help="The service to ask about: paramserver.v1.Checkpoints is NOT_SERVING while "
     "checkpoint writes fail.")  # fmt: skip
@apply(SECURITY_OPTIONS)
def health(server_address: str, timeout: float, service: str, **kw: Any) -> None:
    """Exit 0 if the server's gRPC health service says SERVING (for container healthchecks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from paramserver.errors import ServerUnavailable, from_rpc_error
    from paramserver.transport.stub import connect

    channel = connect(server_address, timeout, security_config(kw))
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.RpcError as err:
        raise from_rpc_error(err, f"health check of {server_address}") from None
    finally:
        channel.close()
    state = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise ServerUnavailable(f"{server_address} is {state}")
    click.echo(f"{server_address} {state}")


@cli.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@opt("--out", env="PLOT_OUT", default=None, help="PNG to write [default: RUN_DIR/curve.png].")
def plot(run_dir: str, out: str | None) -> None:
    """Draw a run folder's loss, accuracy and throughput curves to a PNG."""
    from paramserver.cluster.rundir import RunDir

    path = RunDir.open(run_dir).plot(out=out)
    click.echo(str(path))


@cli.command()
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False))
@opt("--model", env="MODEL", required=True, help="The run's --model.")
@opt("--seed", env="SEED", type=int, default=0, help="The run's --seed (frozen parameters).")
@opt("--round", "round_", env="EXPORT_ROUND", type=int, default=None,
     help="Export the cuts of this round [default: the last checkpoints, if they agree].")  # fmt: skip
@opt("--out", env="EXPORT_OUT", default="model.pt", help="Checkpoint to write.")
def export(checkpoint_dir: str, model: str, seed: int, round_: int | None, out: str) -> None:
    """Write a run's whole model from its servers' checkpoints in CHECKPOINT_DIR: every
    shard's part and sparse table rows, no server needed (see docs/guide.md)."""
    from paramserver.server.export import export as write

    path, version = write(checkpoint_dir, model, seed, out, round_)
    click.echo(f"{path}: version {version}")


BENCHMARKS = ("transport", "step", "straggler", "scaling", "accuracy", "wakeup", "sparse")


@cli.command()
@click.argument("name", type=click.Choice(BENCHMARKS))
@opt(
    "--json", "as_json", env="JSON", is_flag=True, help="Print one JSON line of figures and ratios."
)
@opt("--quick", env="BENCH_QUICK", is_flag=True, help="A few seconds' version (CI runs it).")
def bench(name: str, as_json: bool, quick: bool) -> None:
    """Measure NAME against its baseline, side by side in one run; see docs/BENCHMARKS.md.

    transport: push and pull of a 64 MiB model against raw TCP and memcpy.
    step: one worker's step against a local training step (batch 64 and 256).
    straggler: 2 workers, one 3x slower, under async and delay-1, against PyTorch DDP.
    scaling: samples/s of 1, 2 and 4 workers under each policy, against one local process.
    accuracy: wall time to 88% Fashion-MNIST test accuracy per policy, against one local
    process and DDP.
    wakeup: a round trip between two processes through each candidate for the same-host
    control path (gRPC call, Unix socket, pipe, eventfd, semaphore, futex).
    sparse: a DLRM with a 1M x 64 table as server rows, against the same table dense, one
    local process and DDP; then a table of which 2 GB of rows exist on the server.
    """
    import importlib

    from paramserver.bench.common import report

    module = importlib.import_module(f"paramserver.bench.{name}")
    rows, figures = module.run(quick)
    figures["quick"] = quick
    report(name, rows, figures, as_json)


def main(argv: list[str] | None = None) -> None:
    """Entry point: errors become one line on stderr and a non-zero exit."""
    from paramserver.cluster.procs import die_with_parent_if_asked

    die_with_parent_if_asked()
    try:
        cli.main(args=argv, prog_name="paramserver", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("paramserver: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"paramserver: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except (ConfigError, DataUnavailable) as exc:
        click.echo(f"paramserver: error: {exc}", err=True)
        sys.exit(2)
    except ParamServerError as exc:
        click.echo(f"paramserver: error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("paramserver: interrupted", err=True)
        sys.exit(130)
