"""``paramserver server | worker | launch | chaos``: the commands that train. Their options are the
parts of ``cluster/commands.py``; each builds its configs from what they gave, then runs
(or with ``--print-config`` prints them). Torch is imported only to run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

import click

from paramserver import settings
from paramserver.cli.flags import Chaos
from paramserver.cli.options import command, derived, fill_defaults, printed
from paramserver.cluster import commands, roles, torchx_roles
from paramserver.config import MODEL_DEFAULTS, LaunchConfig, Security, ServerConfig, WorkerConfig
from paramserver.errors import ConfigError, ParamServerError

log = logging.getLogger("paramserver")
EVALUATION_WAIT = 600  # --exit-when-done: seconds the last evaluation may take


def security_config(kw: dict[str, Any]) -> Security:
    """The Security that the TLS and token options in ``kw`` give (taken out of ``kw``)."""
    security: Security = settings.build(Security, kw)
    return security


def server_config(kw: dict[str, Any], **fixed: Any) -> ServerConfig:
    """The ServerConfig that the server options in ``kw`` give (taken out of ``kw``)."""
    cfg: ServerConfig = settings.build(ServerConfig, kw, **fixed)
    return cfg


def model_defaults(kw: dict[str, Any]) -> None:
    """What the model's ``MODEL_DEFAULTS`` say, where no source gave a value."""
    fill_defaults(kw, MODEL_DEFAULTS.get(kw["model"], {}), f"model {kw['model']}")


@command(*commands.SERVER)
def server(**kw: Any) -> None:
    """Run a parameter server until SIGTERM or Ctrl-C (both write a last checkpoint).

    After each epoch it evaluates the global model on the test set: `status` shows the
    figures, and the run folder (--run-dir) gets metrics.jsonl, then curve.png and
    summary.json at the end.

    Under a TF_CONFIG (Kubeflow TFJob, Volcano) a "ps" task takes its shard, port and the
    number of workers from it, unless given.
    """
    task = roles.tf_config(os.environ)
    if task is not None:
        fill_defaults(kw, roles.server_settings(task), "TF_CONFIG")
    if kw["shard"].strip() == "auto":
        shard = roles.auto_shard(socket.gethostname(), os.environ)
        derived(kw, "shard", shard, "--shard auto: the host name and PARAMSERVER_SHARDS")
    tx = torchx_roles.from_env(os.environ)
    if tx is not None:
        placed = torchx_roles.server_settings(tx, kw["shard"])
        fill_defaults(kw, placed, torchx_roles.ENV)
        if kw["port"] != placed["port"]:  # the workers dial the component's port + 2i
            raise ConfigError(
                f"Under the torchx component shard {kw['shard']} listens on {placed['port']} "
                f"(its --port + 2i), where the workers dial it; got --port {kw['port']}: give "
                "the port to the component, not after --."
            )
    model_defaults(kw)
    cfg = server_config(kw)
    if printed():
        return
    from paramserver.cluster import server_evaluation
    from paramserver.cluster.procs import READY_MARKER
    from paramserver.server.app import ServerApp
    from paramserver.server.disk.checkpoint_writer import checkpoint_folder

    log.info("server configuration: %s", cfg)
    if cfg.checkpoint_dir:  # refused before the run folder in it (--run-dir auto) is planned
        checkpoint_folder(cfg.checkpoint_dir)
    report = settings.build(commands.ServerRun, kw)
    planned = server_evaluation.plan(cfg, report.run_dir, report.data_dir)
    try:
        app = ServerApp(cfg).start()
    except BaseException:
        if planned is not None:
            planned.discard()
        raise
    evaluation = planned.start(app) if planned is not None else None
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    if report.exit_when_done:
        threading.Thread(
            target=exit_when_done, args=(app, evaluation, stop), name="ps-done", daemon=True
        ).start()
    click.echo(f"{READY_MARKER} {app.address}", nl=True)
    sys.stdout.flush()
    stop.wait()
    if received:
        log.info("%s received: stopping", signal.Signals(received[0]).name)
    else:
        log.info("the run is over and every worker has left: stopping (--exit-when-done)")
    if evaluation is not None:
        evaluation.stop(timeout=2.0)  # the last checkpoint first: an evaluation can wait
    app.stop(grace=2.0)
    unfinished = evaluation.unfinished() if evaluation is not None and not received else None
    if unfinished:  # --exit-when-done waited for it in vain: not the exit of a run all well
        raise ParamServerError(unfinished)


def exit_when_done(app: Any, evaluation: Any, stop: threading.Event) -> None:
    """``--exit-when-done``: set ``stop`` once the run is over and every worker has gone,
    and the last epoch's evaluation (on the shard that runs it) is written, or
    ``EVALUATION_WAIT`` seconds have passed. A failure here is logged and tried again."""
    while not stop.is_set():
        try:
            c = app.coordinator
            if not c.wait_for(lambda c: c.members.done or stop.is_set(), timeout=1.0):
                continue
            if stop.is_set():  # a signal came first
                return
            waits = evaluation is not None and c.members.finished
            if waits and not evaluation.wait(EVALUATION_WAIT):
                log.warning("the last evaluation did not end in %ds: stopping", EVALUATION_WAIT)
            stop.set()
        except Exception:
            log.exception("--exit-when-done's watch failed; it looks again in a second")
            stop.wait(1.0)


@command(*commands.WORKER, elsewhere=commands.servers_own())
def worker(**kw: Any) -> None:
    """Join a server and train on the batches it hands out until the run is finished.

    Under a TF_CONFIG (Kubeflow TFJob, Volcano) a "worker" or "chief" task dials the ps
    tasks, and under torchx (paramserver.launchers.torchx) the server role's replicas,
    unless --server is given.
    """
    task = roles.tf_config(os.environ)
    if task is not None:
        fill_defaults(kw, roles.worker_settings(task), "TF_CONFIG")
    tx = torchx_roles.from_env(os.environ)
    if tx is not None and not kw["server_address"]:
        slurm = tx.rank0_env.startswith("SLURM_")
        resolve = torchx_roles.node_address if slurm else str
        fill_defaults(kw, torchx_roles.worker_settings(tx, os.environ, resolve), torchx_roles.ENV)
    if not kw["server_address"]:
        raise ConfigError(
            "Give the server's address: --server HOST:PORT (or PARAMSERVER_SERVER, server in "
            "the config file's [worker] table, or a TF_CONFIG that lists the ps tasks)."
        )
    cfg: WorkerConfig = settings.build(WorkerConfig, kw)
    procs = settings.build(commands.Procs, kw).procs
    if printed():
        return
    if procs > 1:
        from paramserver.cluster.worker_procs import run_worker_procs

        sys.exit(run_worker_procs(cfg, procs))
    from paramserver.training.trainer import run

    log.info("worker configuration: %s", cfg)
    summary = run(cfg)
    click.echo(json.dumps(summary.__dict__))


@command(*commands.LAUNCH)
def launch(**kw: Any) -> None:
    """Train on a local cluster: one server and --workers worker processes.

    The learning rate follows a cosine decay over the whole run unless --lr-schedule constant.

    Evaluates the global model on the test set after every epoch and writes a run folder
    (config.json, metrics.jsonl, curve.png, checkpoint.pt, summary.json, logs).
    """
    from paramserver.cluster.launch import launch as run_launch
    from paramserver.cluster.launch import planned_optimizer_steps
    from paramserver.training import data

    model_defaults(kw)
    as_json = settings.build(commands.LaunchOutput, kw).json
    if kw["lr_schedule"] != "constant" and kw["lr_total_steps"] is None:
        # The schedule spans the whole run, which launch can work out from the plan.
        plan = server_config({**kw, "lr_schedule": "constant"}, host="127.0.0.1", port=0)
        samples = data.train_size(kw["dataset"], kw["data_dir"])
        steps = planned_optimizer_steps(plan, samples, kw["push_every"])
        derived(kw, "lr_total_steps", steps, "launch: the run's optimizer steps")
    local = server_config(kw, host="127.0.0.1", port=0)
    cfg: LaunchConfig = settings.build(LaunchConfig, kw, server=local)
    if printed():
        return
    summary = run_launch(cfg)
    line = json.dumps(summary)
    if as_json:
        click.echo(line)
    else:
        click.echo(
            f"{summary['policy_label']}, {_count(summary['workers'], 'worker')}, "
            f"{_count(summary['epochs'], 'epoch')}: "
            f"{_tested(summary)}, "
            f"{summary['samples_per_s']:.0f} samples/s, wall {summary['wall_s']:.1f}s, "
            f"max staleness {summary['max_staleness']}; run folder {summary['run_dir']}"
        )
    if summary["failed_workers"]:
        raise ParamServerError(
            f"Workers failed: {', '.join(summary['failed_workers'])}; see their logs in {summary['run_dir']}."
        )


@command(Chaos)
def chaos(**kw: Any) -> None:
    """Run a local cluster (2 shards, 3 workers, a sparse table and BatchNorm) while faults
    of mixed kinds are injected from a seeded schedule; then the same run uninterrupted, and
    the invariants: every batch once, every recovery bounded, the same result, every
    checkpoint readable. Exits 1 when one fails (see docs/RESULTS.md)."""
    opts: Chaos = settings.build(Chaos, kw)
    if printed():
        return
    from paramserver.cluster import chaos as soak
    from paramserver.cluster.faults import parse_kinds

    try:
        kinds = parse_kinds(opts.kinds)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    kinds = soak.linkable(kinds, asked="link-down" in opts.kinds)
    cfg = soak.ChaosConfig(
        faults=opts.faults,
        seed=opts.seed,
        policy=opts.policy,
        kinds=kinds,
        lease=opts.lease,
        recover_within=opts.recover_within,
        workdir=opts.workdir,
        local_steps=opts.local_steps,
        overlap=opts.overlap == "on",
        clip=opts.clip,
    )
    if not soak.main(cfg, opts.json):
        sys.exit(1)


def _tested(summary: dict[str, Any]) -> str:
    """A summary's headline test figures: accuracy (the loss where there is none), the AUC
    and the perplexity where there is one."""
    accuracy = summary.get("test_accuracy")
    parts = [f"test accuracy {100 * accuracy:.2f}%" if accuracy is not None else ""]
    parts.append(f"test loss {summary['test_loss']:.4f}" if accuracy is None else "")
    parts.append(f"test AUC {summary['test_auc']:.4f}" if "test_auc" in summary else "")
    ppl = summary.get("test_perplexity")
    parts.append(f"test perplexity {ppl:.2f}" if ppl is not None else "")
    return ", ".join(p for p in parts if p)


def _count(n: int, noun: str) -> str:
    """``1 epoch``, ``2 epochs``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
