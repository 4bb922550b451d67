"""Command line: ``paramserver server | worker | launch | status``.

Every option can also be set through the ``PARAMSERVER_*`` variable shown in its help.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import click

from paramserver.codec import compression
from paramserver.config import (
    DATASETS,
    LR_SCHEDULES,
    OPTIMIZERS,
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


def apply(options: list[Callable[[F], F]]) -> Callable[[F], F]:
    def decorate(func: F) -> F:
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


SERVER_OPTIONS = [
    opt("--model", env="MODEL", default="mlp", help="Model factory: mlp, cnn or module:function."),
    opt("--optimizer", env="OPTIMIZER", type=click.Choice(OPTIMIZERS), default="adam", help="Server-side optimizer."),
    opt("--lr", env="LR", type=float, default=1e-3, help="Learning rate."),
    opt("--momentum", env="MOMENTUM", type=float, default=0.9, help="Momentum (optimizer 'momentum' only)."),
    opt("--weight-decay", env="WEIGHT_DECAY", type=float, default=0.0, help="Weight decay."),
    opt("--lr-total-steps", env="LR_TOTAL_STEPS", type=int, default=None, help="Optimizer steps the cosine schedule spans [launch: the whole run]."),
    opt("--policy", env="POLICY", default="delay-1", help="Staleness policy: sync, delay-1, ssp:K or async."),
    opt("--workers", env="WORKERS", type=int, default=2, help="Most workers live at once; training starts when --min-workers have joined."),
    opt("--min-workers", env="MIN_WORKERS", type=int, default=None, help="Workers that must join before training starts [default: --workers]; more may join later."),
    opt("--dataset", env="DATASET", type=click.Choice(DATASETS), default="fashion-mnist", help="Training data the workers use."),
    opt("--batch-size", env="BATCH_SIZE", type=int, default=64, help="Batch size of each worker."),
    opt("--epochs", env="EPOCHS", type=int, default=8, help="Passes over the training set."),
    opt("--seed", env="SEED", type=int, default=0, help="Seeds the initial weights and the data order."),
    opt("--lease-timeout", env="LEASE_TIMEOUT", type=float, default=10.0, help="Seconds without a call after which a worker is dropped from every barrier."),
    opt("--chunk-bytes", env="CHUNK_BYTES", type=int, default=1 << 20, help="Size of the streamed payload chunks."),
    opt("--checkpoint-dir", env="CHECKPOINT_DIR", default=None, help="Save the server's state here (and on SIGTERM); resume from it at start-up when it holds one."),
    opt("--checkpoint-every", env="CHECKPOINT_EVERY", default="60s", help="With --checkpoint-dir: every N optimizer steps (500) or N seconds (30s, 5m)."),
    opt("--skip-nonfinite", env="SKIP_NONFINITE", is_flag=True, default=False, help="Skip and count gradients holding NaN or Inf instead of failing the push."),
]  # fmt: skip

SECURITY_OPTIONS = [
    opt("--tls-cert", env="TLS_CERT", default=None, help="PEM certificate: the server's, or the worker's client certificate."),
    opt("--tls-key", env="TLS_KEY", default=None, help="PEM private key of --tls-cert."),
    opt("--tls-ca", env="TLS_CA", default=None, help="PEM CA bundle: on the server, clients must present a certificate it signed (mutual TLS); on clients, it verifies the server."),
    opt("--token", env="TOKEN", default=None, help="Shared secret: the server refuses calls without it (UNAUTHENTICATED). Prefer the variable to the flag, which shows in ps."),
]  # fmt: skip


def security_config(kw: dict[str, Any]) -> Security:
    return Security(
        cert=kw.pop("tls_cert"), key=kw.pop("tls_key"), ca=kw.pop("tls_ca"), token=kw.pop("token")
    )


def server_config(
    kw: dict[str, Any], host: str, port: int, threads: int, sec: Security | None = None
) -> ServerConfig:
    return ServerConfig(
        model=kw["model"],
        optimizer=OptimizerConfig(
            kw["optimizer"],
            kw["lr"],
            kw["momentum"],
            kw["weight_decay"],
            kw["lr_schedule"],
            kw["lr_total_steps"],
        ),  # fmt: skip
        policy=kw["policy"],
        workers=kw["workers"],
        dataset=kw["dataset"],
        batch_size=kw["batch_size"],
        epochs=kw["epochs"],
        seed=kw["seed"],
        host=host,
        port=port,
        lease_seconds=kw["lease_timeout"],
        chunk_bytes=kw["chunk_bytes"],
        threads=threads,
        min_workers=kw["min_workers"],
        checkpoint_dir=kw["checkpoint_dir"],
        checkpoint_every=kw["checkpoint_every"],
        skip_nonfinite=kw["skip_nonfinite"],
        security=sec or Security(),
    )


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
    return opt("--lr-schedule", env="LR_SCHEDULE", type=click.Choice(LR_SCHEDULES), default=default,
               help="constant, or cosine decay to 0 over --lr-total-steps optimizer steps.")  # fmt: skip


@cli.command()
@apply(SERVER_OPTIONS)
@lr_schedule_option("constant")
@opt("--host", env="HOST", default="0.0.0.0", help="Address to listen on.")
@opt("--port", env="PORT", type=int, default=50051, help="Port to listen on (0: any free port).")
@opt("--threads", env="SERVER_THREADS", type=int, default=1, help="Torch threads of the optimizer.")
@opt(
    "--metrics-port",
    env="METRICS_PORT",
    type=int,
    default=None,
    help="Serve Prometheus metrics on http://HOST:PORT/metrics [default: off].",
)
@opt(
    "--shard",
    env="SHARD",
    default="0/1",
    help="I/S: hold the I-th of S equal contiguous ranges of the flat parameters; run one "
    "server per shard and give workers every address, in order (--server A,B,...).",
)
@apply(SECURITY_OPTIONS)
def server(
    host: str, port: int, threads: int, metrics_port: int | None, shard: str, **kw: Any
) -> None:
    """Run a parameter server until SIGTERM or Ctrl-C (both write a last checkpoint)."""
    import dataclasses

    from paramserver.launch import READY_MARKER
    from paramserver.server.app import ServerApp

    cfg = server_config(kw, host, port, threads, security_config(kw))
    index, shards = parse_shard(shard)
    cfg = dataclasses.replace(cfg, metrics_port=metrics_port, shard=index, shards=shards)
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


WORKER_OPTIONS = [
    opt("--device", env="DEVICE", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N."),
    opt("--threads", env="THREADS", type=int, default=1, help="Torch threads per worker process."),
    opt("--data-dir", env="DATA_DIR", default=None, help="Folder of Fashion-MNIST (or MNIST) IDX files [default: Debian's /usr/share/datasets/fashion-mnist]."),
    opt("--step-delay", env="STEP_DELAY", type=float, default=0.0, help="Extra seconds per step: simulates a straggler."),
    opt("--overlap", env="OVERLAP", type=click.Choice(["auto", "on", "off"]), default="auto", help="Push in the background while the next step computes (ssp:K, async); with shared memory, also fetch the next weights meanwhile; auto: on for CUDA, off on CPU."),
    opt("--compress", env="COMPRESS", type=click.Choice(compression.CHOICES), default="none", help="Element type of gradients streamed over gRPC (half the bytes; the server keeps float32). Not used through shared memory."),
    opt("--push-every", env="PUSH_EVERY", type=click.IntRange(1, 1024), default=1, help="Compute K of the server's batches, accumulating their gradients, per push: K times fewer round trips, K times the batch per optimizer step."),
    opt("--shm", env="SHM", type=click.Choice(["on", "off"]), default="on", help="Offer the server a /dev/shm segment for the payloads; used only when the server shares this host (otherwise gRPC streams)."),
]  # fmt: skip


@cli.command()
@opt(
    "--server",
    "server_address",
    env="SERVER",
    required=True,
    help="The server's HOST:PORT; for sharded servers every shard's, in shard order: A,B,...",
)
@apply(WORKER_OPTIONS)
@opt(
    "--procs",
    env="PROCS",
    type=int,
    default=1,
    help="Worker processes to start on this host (one per GPU when there are several).",
)
@opt(
    "--name",
    env="NAME",
    default=None,
    help="Name shown in the server's status [default: host:pid].",
)
@opt("--max-steps", env="MAX_STEPS", type=int, default=None, help="Stop after this many steps.")
@opt(
    "--rpc-timeout",
    env="RPC_TIMEOUT",
    type=float,
    default=60.0,
    help="Deadline of each call but pulls, in seconds.",
)
@opt(
    "--barrier-timeout",
    env="BARRIER_TIMEOUT",
    type=float,
    default=900.0,
    help="Seconds a pull may wait for slower workers before the worker fails.",
)
@opt(
    "--server-timeout",
    env="SERVER_TIMEOUT",
    type=float,
    default=300.0,
    help="Seconds to keep retrying (backoff with jitter) while the server is unreachable, "
    "e.g. restarting, before the worker gives up.",
)
@apply(SECURITY_OPTIONS)
def worker(server_address: str, procs: int, **kw: Any) -> None:
    """Join a server and train on the batches it hands out until the run is finished."""
    sec = security_config(kw)
    cfg = WorkerConfig(server=server_address, security=sec, **kw)
    if procs < 1:
        raise ConfigError(f"--procs must be at least 1; got {procs}.")
    if procs > 1:
        sys.exit(_run_procs(cfg, procs, kw))
    from paramserver.worker.trainer import run

    log.info("worker configuration: %s", cfg)
    summary = run(cfg)
    click.echo(json.dumps(summary.__dict__))


def _run_procs(cfg: WorkerConfig, procs: int, kw: dict[str, Any]) -> int:
    """Start ``procs`` single-process workers here and wait for all of them."""
    import os
    import tempfile
    from pathlib import Path

    import torch

    from paramserver.procs import Child, stop_all
    from paramserver.worker.trainer import process_devices

    devices = process_devices(cfg.device, procs, torch.cuda.device_count())
    logdir = Path(tempfile.mkdtemp(prefix="paramserver-workers-"))
    children = []
    try:
        for i in range(procs):
            device = devices[i]
            args = ["worker", "--server", cfg.server, "--device", device, "--threads", str(cfg.threads),
                    "--name", f"{cfg.name or os.uname().nodename}-{i}", "--step-delay", repr(cfg.step_delay),
                    "--rpc-timeout", repr(cfg.rpc_timeout), "--barrier-timeout", repr(cfg.barrier_timeout),
                    "--overlap", cfg.overlap, "--shm", cfg.shm, "--compress", cfg.compress, "--push-every", str(cfg.push_every), "--server-timeout", repr(cfg.server_timeout)]  # fmt: skip
            sec = cfg.security
            for flag, value in (
                ("--tls-cert", sec.cert),
                ("--tls-key", sec.key),
                ("--tls-ca", sec.ca),
            ):
                if value:
                    args += [flag, value]
            # The token goes by the environment, which children inherit, never by argv.
            for flag, key in (("--data-dir", "data_dir"), ("--max-steps", "max_steps")):
                if kw.get(key) is not None:
                    args += [flag, str(kw[key])]
            env = {"PARAMSERVER_TOKEN": sec.token} if sec.token else None
            children.append(Child(f"worker-{i}", args, logdir / f"worker-{i}.log", env=env))
        log.info("started %d worker processes; logs in %s", procs, logdir)
        worst = 0
        for child in children:
            code = child.proc.wait()
            if code != 0:
                log.error("%s exited with code %d: %s", child.name, code, child.tail())
                worst = worst or 1
        return worst
    finally:
        stop_all(children)


@cli.command()
@apply(SERVER_OPTIONS)
@lr_schedule_option("cosine")
@apply(WORKER_OPTIONS)
@opt("--runs-dir", env="RUNS_DIR", default="runs", help="Where run folders are made.")
@opt("--run-dir", env="RUN_DIR", default=None, help="Use exactly this run folder.")
@opt(
    "--server-threads",
    env="SERVER_THREADS",
    type=int,
    default=1,
    help="Torch threads of the server's optimizer.",
)
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
@opt(
    "--servers",
    env="SERVERS",
    type=click.IntRange(1, 64),
    default=1,
    help="Server processes, each holding one shard of the parameters (--shard I/S).",
)
def launch(runs_dir: str, run_dir: str | None, server_threads: int, as_json: bool, progress: bool,
           device: str, threads: int, data_dir: str | None, step_delay: float, overlap: str,
           shm: str, compress: str, push_every: int, servers: int, **kw: Any) -> None:  # fmt: skip
    """Train on a local cluster: one server and --workers worker processes.

    The learning rate follows a cosine decay over the whole run unless --lr-schedule constant.

    Evaluates the global model on the test set after every epoch and writes a run folder
    (config.json, metrics.jsonl, curve.png, checkpoint.pt, summary.json, logs).
    """
    from paramserver import data
    from paramserver.launch import launch as run_launch
    from paramserver.launch import planned_optimizer_steps

    if kw["lr_schedule"] == "cosine" and kw["lr_total_steps"] is None:
        # The schedule spans the whole run, which launch can work out from the plan.
        plan = server_config({**kw, "lr_schedule": "constant"}, "127.0.0.1", 0, server_threads)
        kw["lr_total_steps"] = planned_optimizer_steps(
            plan, data.train_size(kw["dataset"], data_dir), push_every
        )
    cfg = LaunchConfig(
        server=server_config(kw, "127.0.0.1", 0, server_threads),
        device=device, threads=threads, data_dir=data_dir, runs_root=runs_dir,
        run_dir=run_dir, step_delay=step_delay, progress=progress, overlap=overlap, shm=shm,
        compress=compress, push_every=push_every, servers=servers,
    )  # fmt: skip
    summary = run_launch(cfg)
    line = json.dumps(summary)
    if as_json:
        click.echo(line)
    else:
        click.echo(
            f"{summary['policy']}, {summary['workers']} workers, {summary['epochs']} epochs: "
            f"test accuracy {100 * summary['test_accuracy']:.2f}%, "
            f"{summary['samples_per_s']:.0f} samples/s, wall {summary['wall_s']:.1f}s, "
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
    from paramserver.stub import Stub, connect

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
    from paramserver.errors import from_rpc_error
    from paramserver.statusview import as_json as to_json
    from paramserver.statusview import render

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
@apply(SECURITY_OPTIONS)
def health(server_address: str, timeout: float, **kw: Any) -> None:
    """Exit 0 if the server's gRPC health service says SERVING (for container healthchecks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from paramserver.errors import ServerUnavailable, from_rpc_error
    from paramserver.stub import connect

    channel = connect(server_address, timeout, security_config(kw))
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="paramserver.v1.ParameterServer"), timeout=timeout
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
    from paramserver.rundir import RunDir

    path = RunDir.open(run_dir).plot(out=out)
    click.echo(str(path))


BENCHMARKS = ("transport", "step", "straggler", "scaling", "accuracy")


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
    """
    import importlib

    from paramserver.bench.common import report

    module = importlib.import_module(f"paramserver.bench.{name}")
    rows, figures = module.run(quick)
    figures["quick"] = quick
    report(name, rows, figures, as_json)


def main(argv: list[str] | None = None) -> None:
    """Entry point: errors become one line on stderr and a non-zero exit."""
    from paramserver.procs import die_with_parent_if_asked

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
