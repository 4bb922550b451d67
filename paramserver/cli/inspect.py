"""``paramserver status | health | plot | export | checkpoint reshard | bench``: the commands that look at a
server, a run or the code. Their options are the settings of ``cli/flags.py`` (and the
TLS and token settings of ``Security``). ``status`` and ``health`` never import torch.
"""

from __future__ import annotations

import time
from typing import Any

import click

from paramserver import settings
from paramserver.bench import BENCHMARKS
from paramserver.cli.flags import Bench, Export, Health, Plot, Query, Reshard, Status
from paramserver.cli.options import command, printed
from paramserver.cli.run import security_config
from paramserver.config import Security
from paramserver.errors import ServerUnavailable


def _connect(address: str, timeout: float, security: Security) -> Any:
    from paramserver.transport.stub import connect

    return connect(address, timeout, security)


@command(Query, Status, Security)
def status(**kw: Any) -> None:
    """Show a server's version, policy, throughput and live workers (clock, lag, samples/s)."""
    address = settings.build(Query, kw).address
    opts: Status = settings.build(Status, kw)
    security = security_config(kw)
    if printed():
        return
    import grpc

    from paramserver._proto import paramserver_pb2 as pb
    from paramserver.cli.statusview import as_json, render
    from paramserver.errors import from_rpc_error
    from paramserver.transport.stub import Stub

    channel = _connect(address, opts.timeout, security)
    stub = Stub(channel)
    try:
        while True:
            try:
                st = stub.Status(pb.StatusRequest(), timeout=opts.timeout)
            except grpc.RpcError as err:
                raise from_rpc_error(err, f"status of {address}") from None
            if opts.json:
                click.echo(as_json(st))
            else:
                if opts.watch is not None:
                    click.clear()
                click.echo(render(st, address))
            if opts.watch is None:
                return
            time.sleep(opts.watch)  # the refresh period the operator asked for
    except KeyboardInterrupt:
        if opts.watch is None:
            raise
        # Ctrl-C is how --watch ends: exit 0, without a word
    finally:
        channel.close()


@command(Query, Health, Security)
def health(**kw: Any) -> None:
    """Exit 0 if the server's gRPC health service says SERVING (for container healthchecks)."""
    address = settings.build(Query, kw).address
    opts: Health = settings.build(Health, kw)
    security = security_config(kw)
    if printed():
        return
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from paramserver.errors import from_rpc_error

    channel = _connect(address, opts.timeout, security)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=opts.service), timeout=opts.timeout
        )
    except grpc.RpcError as err:
        raise from_rpc_error(err, f"health check of {address}") from None
    finally:
        channel.close()
    state = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise ServerUnavailable(f"{address} is {state}")
    click.echo(f"{address} {state}")


@command(Plot)
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
def plot(run_dir: str, **kw: Any) -> None:
    """Draw a run folder's loss, accuracy and throughput curves to a PNG."""
    opts: Plot = settings.build(Plot, kw)
    if printed():
        return
    from paramserver.cluster.rundir import RunDir

    path = RunDir.open(run_dir).plot(out=opts.out)
    click.echo(str(path))


@command(Export)
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False))
def export(checkpoint_dir: str, **kw: Any) -> None:
    """Write a run's whole model from its servers' checkpoints in CHECKPOINT_DIR: every
    shard's part and sparse table rows, no server needed; or, with --snapshot, a serving
    snapshot (see docs/guide.md)."""
    opts: Export = settings.build(Export, kw)
    if printed():
        return
    if opts.snapshot:
        from paramserver.serving import snapshot

        bases = [b.strip() for b in opts.base.split(",") if b.strip()]
        out = snapshot.write(
            checkpoint_dir, opts.model, opts.seed, opts.snapshot, opts.round, bases
        )
        kind = f"a delta of {bases[-1]}" if bases else "a snapshot"
        click.echo(f"{out[0]}: {kind}, version {out[1]}, from {out[2]}")
        return
    from paramserver.server.disk.export import export as write

    path, version, which = write(checkpoint_dir, opts.model, opts.seed, opts.out, opts.round)
    click.echo(f"{path}: version {version}, from {which}")


@click.group()
def checkpoint() -> None:
    """Work on a run's server checkpoints with no server running."""


@command(Reshard)
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False))
def reshard(checkpoint_dir: str, **kw: Any) -> None:
    """Re-partition the server checkpoints in CHECKPOINT_DIR for another shard count
    (--shards): dense ranges, optimizer state and every table's rows, written as the new
    shards' checkpoints that servers started with that --shards resume from. Servers
    started with another --shards on a checkpoint folder do this by themselves."""
    opts: Reshard = settings.build(Reshard, kw)
    if printed():
        return
    from paramserver.server.disk.reshard import reshard as write

    paths, which = write(checkpoint_dir, opts.model, opts.seed, opts.shards, opts.out, opts.round)
    for path in paths:
        click.echo(str(path))
    click.echo(f"re-partitioned for {opts.shards} shard(s), from {which}")


checkpoint.add_command(reshard)


@command(Bench)
@click.argument("name", type=click.Choice(list(BENCHMARKS)))
def bench(name: str, **kw: Any) -> None:
    """Measure NAME against its baseline, side by side in one run; see docs/BENCHMARKS.md.

    transport: push and pull of a 64 MiB model against raw TCP and memcpy.
    step: one worker's step against a local training step (batch 64 and 256); with
    --device cuda, on the GPU for the MLP, the ResNet and a 20M-parameter MLP.
    straggler: 2 workers, one 3x slower, under async and delay-1, against PyTorch DDP;
    sync with a backup worker; local steps (8 a push) under async against sync.
    scaling: samples/s of 1, 2 and 4 workers under each policy (control over the same-host
    socket, and over gRPC calls), against one local process with one torch thread and with a
    thread per core; the CPU a 2-worker step costs, split into the worker's compute, its
    overhead and the server's (cpu_ms_per_step); with --device cuda, 1 and 2 async workers
    sharing the GPU against one local process on it.
    accuracy: wall time to 88% Fashion-MNIST test accuracy per policy, against one local
    process and DDP.
    wakeup: a round trip between two processes through each candidate for the same-host
    control path (gRPC call, Unix socket, pipe, eventfd, semaphore, futex).
    sparse: a DLRM with a 1M x 64 table as server rows, against the same table dense, one
    local process and DDP; the same with admission and a capacity; a declared 8 GiB table
    of which 1 GB of rows come to exist; a shard's memory per row held; then a DLRM on a
    Criteo-like stream (26 tables of the Criteo Kaggle cardinalities, 33.8M rows) sparse
    against its tables dense, a small dense DLRM and one process, its export and serving
    (--only criteo: that case alone).
    network: a worker and a server on two hosts (network namespaces) joined by links shaped
    to 100 Mbit/s, 1 and 10 Gbit/s (--rate): its push and pull over the data port and gRPC
    against raw TCP and the rate; then 2 workers training against DDP on the slowest link
    (fp32, fp32 on 2 shards, bf16, top-k 1%, top-k on 2 shards, and local steps, 32 a
    push in int8, under sync and async: samples/s, bytes, time to 88%, accuracy) (needs
    root; --only VARIANT,...: those variants and DDP, no link figures).
    server: pushes/s one server shard absorbs from pusher processes (no model compute;
    shared memory and the data port), models of 1, 64 and 256 MiB, SGD and Adam, one and
    two shards (shared memory, 64 MiB), and 4 pushers with --coalesce on and off, against
    the bare in-place optimizer pass on the same bytes (--quick: 1 and 16 MiB).
    """
    opts: Bench = settings.build(Bench, kw)
    if printed():
        return
    import importlib

    from paramserver.bench.common import report

    module = importlib.import_module(BENCHMARKS[name])
    if opts.rate and name != "network":
        raise click.UsageError("--rate is for bench network.")
    if opts.only and name not in ("sparse", "network"):
        raise click.UsageError("--only is for bench sparse and network.")
    if opts.device != "auto" and name not in ("step", "scaling"):
        raise click.UsageError("--device is for bench step and scaling.")
    rates = tuple(r.strip() for r in opts.rate.split(",") if r.strip())
    if name == "network":
        rows, figures = module.run(opts.quick, rates, opts.only)
    elif opts.only:
        rows, figures = module.run(opts.quick, opts.only)
    elif name in ("step", "scaling"):
        rows, figures = module.run(opts.quick, opts.device)
    else:
        rows, figures = module.run(opts.quick)
    figures["quick"] = opts.quick
    report(name, rows, figures, opts.json)
