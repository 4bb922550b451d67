"""``paramserver launch``: a local cluster (one server, N workers) with evaluation and a run folder."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch
from tqdm import tqdm

from paramserver._proto import paramserver_pb2 as pb
from paramserver.cluster import commands
from paramserver.cluster.commands import CHILD_ENV, server_args, worker_args
from paramserver.cluster.commands import launch_args as launch_args  # the benchmarks' import
from paramserver.cluster.epochs import EpochReport, Job
from paramserver.cluster.procs import READY_MARKER, Child, stop_all
from paramserver.cluster.reading import ShardReader
from paramserver.cluster.rundir import RunDir
from paramserver.codec import layout
from paramserver.codec.rows import TableSpec
from paramserver.config import LaunchConfig, Security, ServerConfig
from paramserver.errors import ParamServerError, from_rpc_error
from paramserver.server.disk import checkpoint
from paramserver.sparse.remote import RemoteTables
from paramserver.sparse.tableset import WHOLE_TABLE_BYTES, too_large_for_whole
from paramserver.training import data
from paramserver.transport.stub import Stub, connect

log = logging.getLogger(__name__)


def planned_optimizer_steps(cfg: ServerConfig, train_samples: int, push_every: int = 1) -> int:
    """Optimizer steps of a whole run: one per push of ``push_every`` batches, or under sync
    one per round of ``--workers`` such pushes."""
    batches = cfg.epochs * data.batches_per_epoch(train_samples, cfg.batch_size)
    pushes = math.ceil(batches / push_every)
    return math.ceil(pushes / cfg.workers) if cfg.parsed_policy.synchronous else pushes


@dataclass(frozen=True)
class Placement:
    """Where a launch's processes run (``bench network``: each on a host of its own, a
    network namespace): ``host(i)``, the address shard i binds (None: the config's);
    ``prefix(name)``, the command a child named ``name`` (``server``, ``server-I``,
    ``worker-I``) runs in (e.g. ``ip netns exec NS``, which keeps its pid)."""

    host: Callable[[int], str] | None = None
    prefix: Callable[[str], list[str]] = lambda name: []


class _Cluster:
    """The processes of one launch (``--servers`` shards, then the workers) and the observer
    connections to the servers."""

    def __init__(self, cfg: LaunchConfig, run: RunDir, place: Placement | None = None):
        self.cfg = cfg
        self.run = run
        self.place = place or Placement()
        self.children: list[Child] = []
        self.channels: list[grpc.Channel] = []

    def start(self) -> str:
        shards = self.cfg.servers
        addresses = []
        for i in range(shards):
            host = self.place.host(i) if self.place.host else self.cfg.server.host
            scfg = commands.shard_config(self.cfg.server, i, shards, host)
            name = "server" if shards == 1 else f"server-{i}"
            log_path = self.run.file(f"{name}.log")
            prefix = self.place.prefix(name)
            server = Child(
                name, server_args(scfg), log_path, capture_stdout=True, env=CHILD_ENV, prefix=prefix
            )
            self.children.append(server)
            line = server.wait_for_line(READY_MARKER, self.cfg.startup_timeout)
            addresses.append(line.rsplit(" ", 1)[-1])
        address = ",".join(addresses)
        # Children inherit PARAMSERVER_TOKEN; the launcher's own calls carry it too.
        token = os.environ.get("PARAMSERVER_TOKEN") or None
        for a in addresses:
            self.channels.append(connect(a, self.cfg.startup_timeout, Security(token=token)))
        self.addresses = addresses
        self.reader = ShardReader(self.channels, addresses)
        self.stub = Stub(self.channels[0])  # shard 0 hands out the batches: its status is the run's
        for i in range(self.cfg.server.workers):
            args = worker_args(self.cfg, address, f"worker-{i}")
            log_path = self.run.file(f"worker-{i}.log")
            prefix = self.place.prefix(f"worker-{i}")
            self.children.append(Child(f"worker-{i}", args, log_path, env=CHILD_ENV, prefix=prefix))
        return address

    @property
    def servers(self) -> list[Child]:
        return self.children[: self.cfg.servers]

    @property
    def workers(self) -> list[Child]:
        return self.children[self.cfg.servers :]

    def tables(self, model: torch.nn.Module, specs: list[TableSpec]) -> RemoteTables | None:
        """The servers' tables read by an observer, in place of ``model``'s sparse
        embeddings (none: None)."""
        return self.reader.tables(model, specs)

    def weights(self, manifest: layout.Manifest) -> tuple[int, np.ndarray]:
        """The current weights, gathered from every shard (shard 0's version)."""
        header, flat = self.reader.observe(manifest)
        return header.version, flat

    def status(self) -> pb.StatusResponse:
        try:
            return self.stub.Status(pb.StatusRequest(), timeout=30)
        except grpc.RpcError as err:
            raise from_rpc_error(err, "status of the launched server") from None

    def stop(self) -> None:
        for channel in self.channels:
            channel.close()
        stop_all(self.children)


def launch(cfg: LaunchConfig, place: Placement | None = None) -> dict[str, Any]:
    """Train on a local cluster (its processes where ``place`` says); returns the summary
    that ``launch --json`` prints."""
    t0 = time.perf_counter()
    scfg = cfg.server
    job = Job.prepare(scfg, cfg.data_dir)  # fails before spawning
    run = RunDir(cfg.runs_root, scfg.policy.strip().lower().replace(":", ""), cfg.run_dir)
    ckpt = scfg.checkpoint_dir or ""
    run.check_unused(bool(ckpt) and os.path.isdir(ckpt) and any(os.scandir(ckpt)))
    cfg = _keep_rows(cfg, job.specs, run)
    scfg = cfg.server
    run.write_json("config.json", {"server": _asdict(scfg), "launch": _asdict(cfg, skip="server")})
    log.info("run folder %s", run.path)
    cluster = _Cluster(cfg, run, place)
    failed: list[Child] = []
    say = (lambda line: tqdm.write(line, file=sys.stderr)) if cfg.progress else log.info
    report = EpochReport(run, job, cluster, say, t0)
    try:
        address = cluster.start()
        log.info("server at %s; %d workers started", address, scfg.workers)
        tables = cluster.tables(job.model, job.specs)
        evaluated = _train(cfg, report, cluster, failed)
        # The checkpoint holds exactly the weights the last evaluation saw.
        last = report.record(evaluated + 1)
        state = job.model.state_dict()
        kept = f"in the servers' checkpoints in {scfg.checkpoint_dir}"
        state.update(cluster.reader.whole_tables(tables, "checkpoint.pt", kept))
        checkpoint.save(
            run.file("checkpoint.pt"),
            state,
            version=last.version,
            policy=last.status.policy,
            model=scfg.model,
        )
    finally:
        cluster.stop()
    return report.finish(scfg, last.status, [w.name for w in failed])


def _keep_rows(cfg: LaunchConfig, specs: list[TableSpec], run: RunDir) -> LaunchConfig:
    """``cfg``, with the servers checkpointing into the run folder (``servers/``) when a
    table is not written whole into checkpoint.pt (unbounded, or over 1 GiB) and no
    --checkpoint-dir was given: else its rows would end with the servers. Said before the
    run starts."""
    left_out = {
        s.name: why
        for s in specs
        if (why := too_large_for_whole(s.rows, s.dim, s.dtype, WHOLE_TABLE_BYTES))
    }
    if not left_out or cfg.server.checkpoint_dir:
        return cfg
    folder = str(run.path / "servers")
    log.warning(
        "table(s) %s are not written whole into checkpoint.pt (%s): the servers checkpoint "
        "their rows into %s (no --checkpoint-dir was given), which paramserver export "
        "--snapshot reads",
        ", ".join(repr(name) for name in left_out),
        "; ".join(left_out.values()),
        folder,
    )
    server = dataclasses.replace(cfg.server, checkpoint_dir=folder)
    return dataclasses.replace(cfg, server=server)


def _train(cfg: LaunchConfig, report: EpochReport, cluster: _Cluster, failed: list[Child]) -> int:
    """Watches the run until every worker has exited, evaluating after each epoch but the
    last; returns the epochs evaluated. Raises if a server exits or a worker fails before
    the run could start."""
    scfg, per_epoch = cfg.server, report.job.per_epoch
    total = scfg.epochs * per_epoch * scfg.batch_size
    bar = tqdm(
        total=total, unit="sample", unit_scale=True, disable=not cfg.progress, dynamic_ncols=True
    )
    where = scfg.checkpoint_dir or ""
    evaluated = report.resumed(cluster.status(), scfg.epochs, where)
    try:
        while True:
            finished = all(w.poll() is not None for w in cluster.workers)
            _check_children(cluster, failed)
            st = cluster.status()
            if failed and st.workers_joined < scfg.start_workers:
                # The run waits for --workers joins: without this one it would never start.
                raise ParamServerError(
                    f"{failed[0].name} failed before the run started: {failed[0].tail()}"
                )
            bar.update(st.samples - bar.n)
            bar.set_postfix(
                loss="-" if math.isnan(st.train_loss) else f"{st.train_loss:.3f}",
                v=st.version,
                stale=st.max_staleness,
                live=len(st.workers),
                refresh=False,
            )
            while evaluated < scfg.epochs - 1 and st.batches_done >= (evaluated + 1) * per_epoch:
                evaluated += 1
                report.record(evaluated)
            if finished:
                return evaluated
            time.sleep(0.5)  # progress refresh period
    finally:
        bar.close()


def _check_children(cluster: _Cluster, failed: list[Child]) -> None:
    """Logs each worker that failed, once (adding it to ``failed``); raises if a server exited."""
    for w in cluster.workers:
        code = w.poll()
        if code not in (None, 0) and w not in failed:
            failed.append(w)
            log.error("%s exited with code %s: %s (log: %s)", w.name, code, w.tail(), w.log_path)
    for server in cluster.servers:
        if server.poll() is not None:
            raise ParamServerError(
                f"{server.name} exited with code {server.poll()}: {server.tail()}"
            )


def _asdict(obj: Any, skip: str = "") -> dict[str, Any]:
    d = dataclasses.asdict(obj)
    d.pop(skip, None)
    return d
