"""``paramserver chaos``: many faults in one run, then invariants checked.

With ``--local-steps H`` the workers push pseudo-gradients of H local AdamW steps and the
shards apply Nesterov's outer step (issue 45), the model's table dense: the same faults and
checks, the result's within three points (see ``soak``).

A local cluster (2 server shards with consistent cuts, 3 worker daemons; a model with a
sparse table and BatchNorm on a click log: ``chaos_cluster.py``) trains while faults of
mixed kinds (``faults.py``) are injected from a seeded schedule, one at a time at points
of the run's progress spaced by the room each takes up (``faults.room``). After each, the time until the run is back past where
it was is its recovery. A reader loads the newest checkpoint of every shard again and
again meanwhile. Then the same run without faults, and the checks:

- exactly once: on every shard, every batch of the run applied once (the server's ledger
  and batch plan), and the workers' own logs (``--batch-log``) agree: no batch outside the
  run, none missing but the line a killed worker had not written yet or a worker whose
  link went down never got the answer for (one push a kill-worker or link-down fault:
  ``--local-steps`` H batches), and
  none in two logs unless a shard fault rewound the run past it (its first push undone);
- no hang: every recovery within ``recover_within`` seconds, and the run ends;
- equal result: under ``sync`` with only server-side faults, the final weights and table
  rows equal the uninterrupted run's to float precision; with worker faults, the test
  accuracy within half a point of it (the click log's model learns its teacher: about 71%
  against the majority class's 60%);
- readable: no checkpoint on disk was ever unreadable.
"""

from __future__ import annotations

import collections
import json
import logging
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paramserver.cluster import faults as fault_kinds
from paramserver.cluster import netns
from paramserver.cluster.chaos_cluster import (
    DATA,
    DENSE_MODEL,
    MODEL,
    Cluster,
    Reader,
    data,
    dense_model,
    model,
    wait_until,
)
from paramserver.cluster.faults import WORKER_KINDS, Fault
from paramserver.cluster.netns import Network
from paramserver.cluster.procs import stop_all
from paramserver.cluster.reading import model_state_dict
from paramserver.config.cores import shard_threads
from paramserver.errors import ConfigError, ParamServerError

log = logging.getLogger(__name__)
BATCH, SHARDS, WORKERS = 64, 2, 3
PER_EPOCH = 3072 // BATCH


@dataclass(frozen=True)
class ChaosConfig:
    faults: int = 30
    seed: int = 0
    policy: str = "sync"
    kinds: tuple[str, ...] = fault_kinds.KINDS
    lease: float = 3.0
    cut_every: int = 5
    rounds_between: int = 10  # the run's progress between two faults (optimizer steps)
    step_delay: float = 0.04
    recover_within: float = 60.0
    start_timeout: float = 120.0
    workdir: str | None = None
    local_steps: int = 0  # H: workers push pseudo-gradients of H inner steps (0: gradients)
    overlap: bool = False  # local steps: the exchange behind the next H steps (--overlap on)
    clip: float = 0.0  # the servers' --clip-grad-norm (under sync: relayed between shards)

    @property
    def per_step(self) -> int:
        """Batches an optimizer step applies."""
        return max(1, self.local_steps) * (WORKERS if self.policy == "sync" else 1)

    def build(self) -> torch.nn.Module:
        """The run's model (its table dense under local steps)."""
        return dense_model() if self.local_steps else model()

    def schedule(self) -> list[Fault]:
        """The run's faults, in order (seeded)."""
        return fault_kinds.schedule(self.seed, self.faults, self.kinds, SHARDS, WORKERS, self.lease)

    def points(self) -> list[int]:
        """The step at which each fault is due (``faults.points``)."""
        return fault_kinds.points(self.schedule(), self.rounds_between + self.cut_every + 1)

    @property
    def steps(self) -> int:
        """The run's optimizer steps: every fault's room before the last one's point, and
        past it ``DRIFT``, ``rounds_between`` and two cuts' worth."""
        last = self.points()[-1] + fault_kinds.DRIFT if self.faults else 0
        return last + self.rounds_between + 2 * self.cut_every

    @property
    def epochs(self) -> int:
        return max(2, -(-self.steps * self.per_step // PER_EPOCH))

    @property
    def last_fault_at(self) -> int:
        """No fault is injected past this step."""
        return self.epochs * PER_EPOCH // self.per_step - 2 * self.cut_every


@dataclass
class Recovery:
    fault: str
    at_version: int
    seconds: float
    recovered: bool


@dataclass
class Outcome:
    recoveries: list[Recovery] = field(default_factory=list)
    statuses: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    logged_batches: collections.Counter[int] = field(default_factory=collections.Counter)
    reads: int = 0
    unreadable: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _args(cfg: ChaosConfig, root: Path) -> tuple[list[str], list[str]]:
    server = [
        "--policy", cfg.policy, "--workers", str(WORKERS), "--model", MODEL, "--dataset", DATA,
        "--batch-size", str(BATCH), "--epochs", str(cfg.epochs), "--optimizer", "adam",
        "--lr", "0.01", "--seed", str(cfg.seed), "--lease-timeout", str(cfg.lease),
        "--checkpoint-dir", str(root / "checkpoints"), "--checkpoint-every", str(cfg.cut_every),
        "--data-port", "off",
        # the shards share this host's cores, as launch's do
        "--server-threads", str(shard_threads(None, SHARDS)),
        "--clip-grad-norm", str(cfg.clip),
    ]  # fmt: skip
    worker = [
        "--device", "cpu", "--threads", "1", "--step-delay", str(cfg.step_delay),
        "--server-timeout", "300", "--rpc-timeout", "30",
    ]  # fmt: skip
    if cfg.local_steps:  # DiLoCo's outer step on the servers, AdamW's inner ones on workers
        at = server.index("--model")
        server[at + 1] = DENSE_MODEL
        at = server.index("--optimizer")
        outer = "nesterov" if cfg.policy == "sync" else "delayed-nesterov"  # see the guide
        server[at : at + 4] = ["--optimizer", outer, "--lr", "1.0", "--momentum", "0.5"]
        # outer lr 1 and momentum 0.5: this small model stayed near the majority class with
        # DiLoCo's 0.7 and 0.9 (0.64 against 0.70, H = 4, --faults 0)
        worker += ["--push-every", str(cfg.local_steps), "--inner-optimizer", "adamw"]
        worker += ["--inner-lr", "0.01", "--overlap", "on" if cfg.overlap else "off"]
    return server, worker


def linkable(kinds: tuple[str, ...], asked: bool) -> tuple[str, ...]:
    """``kinds``, less link-down where network namespaces cannot be made here (said once).

    Raises:
        ConfigError: link-down was asked for by name, and namespaces cannot be made.
    """
    if "link-down" not in kinds:
        return kinds
    why = netns.unavailable()
    if why is None:
        return kinds
    if asked:
        raise ConfigError(f"--kinds link-down needs network namespaces: {why}.")
    log.warning("no link-down faults: %s", why)
    return tuple(k for k in kinds if k != "link-down")


def _run(cfg: ChaosConfig, root: Path, schedule: list[Fault]) -> Outcome:
    """One run of the cluster in ``root``, hurt by ``schedule`` (none: the uninterrupted
    run); its workers in network namespaces when it takes a link down."""
    root.mkdir(parents=True, exist_ok=True)
    if not any(f.kind == "link-down" for f in schedule):
        return _run_in(cfg, root, schedule, None)
    with Network([f"w{j}" for j in range(WORKERS)]) as net:
        return _run_in(cfg, root, schedule, net)


def _run_in(cfg: ChaosConfig, root: Path, schedule: list[Fault], net: Network | None) -> Outcome:
    cluster = Cluster(root, SHARDS, WORKERS, *_args(cfg, root), net=net)
    out = Outcome()
    started = time.monotonic()
    reader = Reader(root / "checkpoints", SHARDS)
    try:
        for i in range(SHARDS):
            cluster.start_server(i, cfg.start_timeout)
        for j in range(WORKERS):
            cluster.start_worker(j)
        reader.start()
        last = 0  # where the run was back to after the last fault
        points = cfg.points() if schedule else []
        for n, (fault, point) in enumerate(zip(schedule, points, strict=True), start=1):
            # at its point of the run, and a cut past the last recovery at least
            trigger = max(point, last + cfg.cut_every + 1)
            if not wait_until(
                lambda t=trigger: (cluster.progress() or 0) >= t or cluster.workers_done(),
                cfg.recover_within * 4,
            ):
                raise ParamServerError(f"the run did not reach step {trigger} to inject {fault}")
            if cluster.workers_done() or (cluster.progress() or 0) > cfg.last_fault_at:
                log.warning("the run is at its end before fault %d (%s)", n, fault)
                break
            out.recoveries.append(_inject(cluster, fault, cfg))
            last = cluster.progress() or last
            log.info("fault %d of %d: %s", n, len(schedule), out.recoveries[-1])
        if not wait_until(cluster.workers_done, cfg.recover_within * 10, every=0.5):
            raise ParamServerError("the run did not end: a worker is still running")
        failed = [w for w in cluster.worker_procs if w is not None and w.poll() != 0]
        if failed:
            raise ParamServerError(f"{failed[0].name} failed: {failed[0].tail(3)}")
        state = model_state_dict(cluster.addresses, cfg.build())
        out.state = {k: v.detach().numpy().copy() for k, v in state.items()}
        for i in range(SHARDS):
            st = cluster.status(i)
            out.statuses.append(_status(st) if st is not None else {})
    finally:
        reader.stop()
        stop_all(cluster.procs)
    out.reads, out.unreadable = reader.reads, list(reader.failures)
    for path in root.glob("batches-*.log"):
        for line in path.read_text().splitlines():
            out.logged_batches.update(int(b) for b in line.split())
    out.seconds = time.monotonic() - started
    return out


def _status(st: Any) -> dict[str, Any]:
    keys = ("version", "rounds", "batches_done", "batches_applied", "pushes_repeated", "rows_held")
    return {k: int(getattr(st, k)) for k in keys}


def _inject(cluster: Cluster, fault: Fault, cfg: ChaosConfig) -> Recovery:
    """Carry out ``fault``, and wait until the run is back past where it was."""
    before = cluster.progress() or 0
    t0 = time.monotonic()
    if fault.kind == "kill-worker":
        cluster.signal_worker(fault.target, signal.SIGKILL)
        cluster.start_worker(fault.target)
    elif fault.kind == "stop-worker":
        cluster.signal_worker(fault.target, signal.SIGSTOP)
        time.sleep(fault.hold)  # the fault itself: a process paused this long
        cluster.signal_worker(fault.target, signal.SIGCONT)
    elif fault.kind in ("kill-shard", "kill-all-shards"):
        targets = range(SHARDS) if fault.target < 0 else [fault.target]
        for i in targets:
            cluster.signal_server(i, signal.SIGKILL)
        for i in targets:
            cluster.start_server(i, cfg.start_timeout)
    elif fault.kind == "stop-shard":
        cluster.signal_server(fault.target, signal.SIGSTOP)
        time.sleep(fault.hold)
        cluster.signal_server(fault.target, signal.SIGCONT)
    elif fault.kind == "link-down":
        cluster.link(fault.target, up=False)
        try:
            time.sleep(fault.hold)  # the fault itself: the link down this long
        finally:
            cluster.link(fault.target, up=True)
    elif fault.kind == "disk-full":
        cluster.file_limit(fault.target, 4096)
        time.sleep(fault.hold)
        cluster.file_limit(fault.target, None)
    back = wait_until(
        lambda: (cluster.progress() or -1) > before or cluster.workers_done(),
        cfg.recover_within,
    )
    return Recovery(str(fault), before, round(time.monotonic() - t0, 2), back)


def _accuracy(state: dict[str, np.ndarray], made: torch.nn.Module) -> float:
    made.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    made.eval()
    _, test = data()
    x, y = test.tensors
    with torch.no_grad():
        return float((made(x).argmax(1) == y).float().mean())


def soak(cfg: ChaosConfig) -> dict[str, Any]:
    """Run the schedule and the uninterrupted run; the report, with ``ok`` whether every
    invariant held."""
    schedule = cfg.schedule()
    root = Path(cfg.workdir or tempfile.mkdtemp(prefix="paramserver-chaos-"))
    if root.exists() and any(root.iterdir()):  # its servers would resume another run's files
        raise ConfigError(f"{root} is not empty: give --workdir a new or empty folder.")
    hurt = _run(cfg, root / "chaos", schedule)
    clean = _run(cfg, root / "uninterrupted", [])
    total = cfg.epochs * PER_EPOCH
    checks: dict[str, Any] = {}
    checks["exactly_once"] = (
        all(s.get("batches_applied") == total for s in hurt.statuses)
        and hurt.statuses[0].get("batches_done") == total
    )
    # a worker killed after its push was acknowledged and before it wrote the line loses
    # that line; so does one whose link went down after its push arrived and before the
    # answer came back, when its lease ran out meanwhile (the retry finds no lease, and the
    # worker cannot tell that the push was taken): at most one push a kill-worker or
    # link-down, and a push holds up to --local-steps batches (its line lists them all)
    unlogged = set(range(total)) - set(hurt.logged_batches)
    lossy = sum(1 for f in schedule if f.kind in ("kill-worker", "link-down"))
    may_lose = lossy * max(cfg.local_steps, 1)
    twice = sorted(b for b, n in hurt.logged_batches.items() if n > 1)
    rewinds = any(f.kind not in WORKER_KINDS for f in schedule)
    checks["workers_logs_agree"] = (
        set(hurt.logged_batches) <= set(range(total))
        and len(unlogged) <= may_lose
        and (rewinds or not twice)
    )
    checks["recovered_within"] = all(
        r.recovered and r.seconds <= cfg.recover_within for r in hurt.recoveries
    )
    checks["every_fault_injected"] = len(hurt.recoveries) == len(schedule)
    checks["checkpoints_readable"] = not hurt.unreadable and hurt.reads > 0
    worker_faults = any(f.kind in WORKER_KINDS for f in schedule)
    # weights, float buffers and table rows; integer buffers (BatchNorm's
    # num_batches_tracked) count forward passes, which a batch computed again adds to
    floats = [k for k, v in clean.state.items() if np.issubdtype(v.dtype, np.floating)]
    diff = max(float(np.abs(hurt.state[k] - clean.state[k]).max()) for k in floats)
    counts = {
        k: int(np.abs(hurt.state[k] - clean.state[k]).max()) for k in clean.state if k not in floats
    }
    acc, acc_clean = _accuracy(hurt.state, cfg.build()), _accuracy(clean.state, cfg.build())
    # local steps: a worker's inner optimizer state goes on past a rewound cut, so even
    # server-side faults change the result (not the batches applied)
    if cfg.policy == "sync" and not worker_faults and not cfg.local_steps:
        checks["equal_to_uninterrupted"] = all(
            np.allclose(hurt.state[k], clean.state[k], rtol=1e-5, atol=1e-6) for k in floats
        )
    elif not cfg.local_steps:
        checks["accuracy_within_half_a_point"] = abs(acc - acc_clean) <= 0.005
    else:
        # which worker takes which H batches moves with timing, and each worker's inner
        # AdamW follows its own: two uninterrupted runs of one seed ended 1.7 points apart
        # (0.682 and 0.699 on the 2-core machine); a round lost or applied twice costs far
        # more (the majority class alone scores 0.60)
        checks["accuracy_within_three_points"] = abs(acc - acc_clean) <= 0.03
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "config": {**asdict(cfg), "epochs": cfg.epochs, "batches": total},
        "faults": [asdict(r) for r in hurt.recoveries],
        "by_kind": {k: sum(1 for f in schedule if f.kind == k) for k in cfg.kinds},
        "max_recovery_s": max((r.seconds for r in hurt.recoveries), default=0.0),
        "largest_weight_difference": diff,
        "integer_buffer_differences": counts,
        "unlogged_batches": sorted(unlogged),
        "batches_logged_twice": twice,
        "accuracy": acc,
        "accuracy_uninterrupted": acc_clean,
        "checkpoint_reads": hurt.reads,
        "unreadable": hurt.unreadable,
        "statuses": hurt.statuses,
        "seconds": round(hurt.seconds, 1),
        "seconds_uninterrupted": round(clean.seconds, 1),
        "workdir": str(root),
    }


def render(report: dict[str, Any]) -> str:
    """The report in words: the schedule with each recovery, then the checks."""
    lines = [
        f"{len(report['faults'])} faults in {report['seconds']}s (uninterrupted: "
        f"{report['seconds_uninterrupted']}s; {report['workdir']}):"
    ]
    for n, r in enumerate(report["faults"], start=1):
        lines.append(
            f"  {n:3d}. {r['fault']:<40} at step {r['at_version']:5d}: "
            f"{'back in' if r['recovered'] else 'NOT back after'} {r['seconds']:.1f}s"
        )
    lines.append(
        f"accuracy {report['accuracy']:.4f} (uninterrupted {report['accuracy_uninterrupted']:.4f}); "
        f"largest weight difference {report['largest_weight_difference']:.3g}; "
        f"{report['checkpoint_reads']} checkpoint reads"
    )
    for name, held in report["checks"].items():
        lines.append(f"  {'ok ' if held else 'FAILED'} {name}")
    return "\n".join(lines)


def main(cfg: ChaosConfig, as_json: bool) -> bool:
    report = soak(cfg)
    (Path(report["workdir"]) / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report) if as_json else render(report))
    return bool(report["ok"])
