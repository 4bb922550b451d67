"""``paramserver server``'s own report of its run: after each epoch's batches are applied, a
background thread reads the global model in process (a copy of the last published version,
as an observer's pull takes: no push waits for it), evaluates it on the test set and
records it in the run folder with the code ``launch`` uses (``cluster/epochs.py``) and in
the server's status (``tested_epoch``, ``test_accuracy``, ...). At the end of the run it
draws curve.png and writes summary.json.

``--run-dir auto`` (the default) puts the folder at CHECKPOINT_DIR/run, or without
--checkpoint-dir at runs/STAMP-POLICY; ``off`` evaluates nothing. A folder that cannot be
written at start (config.json) is said in one warning under ``auto``, and the server trains
without evaluating; a named one is refused. A shard of a sharded run holds a slice of the
model and evaluates nothing (``launch`` evaluates a sharded run from every shard).

An evaluation that raises is logged with its traceback, counted (``evaluation_failures``)
and tried again ``RETRY_SECONDS`` later; training never waits for it. An epoch's line is
written once: a failure after it (curve.png, summary.json) retries only those, and a server
restarted after it writes them. A run over whose summary is never written is said by
``unfinished`` (``server --exit-when-done`` then exits 1).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from paramserver._proto import paramserver_pb2 as pb
from paramserver.cluster.epochs import EpochReport, Job, Recorded
from paramserver.cluster.rundir import RunDir
from paramserver.codec import layout
from paramserver.config import ServerConfig
from paramserver.errors import ConfigError, ParamServerError
from paramserver.server.bookkeeping.status import Tested
from paramserver.sparse.embedding import attach_tables
from paramserver.sparse.remote import Observer, RemoteTables

if TYPE_CHECKING:
    from paramserver.server.app import ServerApp
    from paramserver.server.engine.coordinator import Coordinator

log = logging.getLogger(__name__)

AUTO, OFF = "auto", "off"
RETRY_SECONDS = 10.0


@dataclasses.dataclass
class Planned:
    """A server's evaluation, its folder and test set ready before the server starts."""

    run: RunDir
    job: Job
    config: ServerConfig

    def start(self, app: ServerApp, retry: float = RETRY_SECONDS) -> ServerEvaluation:
        return ServerEvaluation(app, self, retry).start()

    def discard(self) -> None:
        """Remove the folder again if it holds only this plan's config.json (the server
        did not start)."""
        if {p.name for p in self.run.path.iterdir()} <= {"config.json"}:
            self.run.file("config.json").unlink(missing_ok=True)
            self.run.path.rmdir()


def plan(cfg: ServerConfig, run_dir: str | None, data_dir: str | None) -> Planned | None:
    """What ``--run-dir`` (and ``--data-dir``, where the test set is) ask of a server about
    to start: None for ``off`` and for a shard of a sharded run. Under ``auto`` a folder that
    cannot be written (config.json, written here, the proof) or a test set that cannot be
    had is said in one warning and the server runs without; named, it is refused.

    Raises:
        ConfigError: a named --run-dir on a shard of a sharded run, one that holds another
            run's metrics or cannot be written, or a test set that cannot be loaded.
    """
    setting = (run_dir or AUTO).strip()
    if setting.lower() == OFF:
        return None
    auto = setting.lower() == AUTO
    if cfg.shards > 1:
        if not auto:
            raise ConfigError(
                f"--run-dir {setting}: shard {cfg.shard}/{cfg.shards} holds a slice of the "
                "model and cannot evaluate it; leave --run-dir out (paramserver launch "
                "evaluates a sharded run from every shard)."
            )
        log.info("shard %d/%d does not evaluate the model: it holds a slice", cfg.shard, cfg.shards)
        return None
    try:
        job = Job.prepare(cfg, data_dir)
    except (OSError, ValueError, ParamServerError) as exc:
        if not auto:
            raise ConfigError(f"--run-dir {setting}: {exc}") from exc
        log.warning(
            "this server will not evaluate the model after each epoch: %s (give --data-dir "
            "where the test set is, or --run-dir off to say no)",
            exc,
        )
        return None
    try:
        run = _folder(cfg, None if auto else setting)
        run.write_json("config.json", {"server": _shown(cfg)})
        run.check_writable()
    except OSError as exc:  # read-only, a full disk, a file-size limit, not a folder
        if not auto:
            raise ConfigError(
                f"--run-dir {setting} cannot be written ({exc}): give a folder this server "
                "can write, or --run-dir off."
            ) from exc
        log.warning(
            "this server will not evaluate the model after each epoch: its run folder cannot "
            "be written (%s); give --run-dir a folder it can write, or --run-dir off to say no",
            exc,
        )
        return None
    log.info("run folder %s: the test figures after each epoch go there", run.path)
    return Planned(run, job, cfg)


def _shown(cfg: ServerConfig) -> dict[str, object]:
    """``cfg`` as config.json holds it: the token only said to be set, as the log says it."""
    shown = dataclasses.asdict(cfg)
    shown["security"]["token"] = "set" if cfg.security.token else None
    return shown


def _folder(cfg: ServerConfig, named: str | None) -> RunDir:
    """The run folder: ``named``, else CHECKPOINT_DIR/run, else a new one under runs/. A
    folder holding another run's metrics takes this one only if it resumes from its
    checkpoints; else a named one is refused and the default makes a fresh one beside."""
    label = cfg.policy.strip().lower().replace(":", "")
    ckpt = cfg.checkpoint_dir or ""
    # a checkpoint to resume from: anything in the folder but the run folders themselves
    resuming = os.path.isdir(ckpt) and any(not e.name.startswith("run") for e in os.scandir(ckpt))
    if named is not None:
        run = RunDir("", label, named)
        run.check_unused(resuming)
        return run
    if not ckpt:
        return RunDir("runs", label)
    run = RunDir("", label, Path(ckpt) / "run")
    try:
        run.check_unused(resuming)
        return run
    except ConfigError:
        log.warning("%s holds another run's metrics: this run's go beside it", run.path)
        return RunDir(ckpt, f"run-{label}")


class InProcess:
    """A ``Source`` that reads the server's own state: its status, and its weights as an
    observer's pull does (the last published version, copied)."""

    def __init__(self, app: ServerApp):
        self.app = app

    def status(self) -> pb.StatusResponse:
        return self.app.coordinator.status().to_proto()

    def weights(self, manifest: layout.Manifest) -> tuple[int, np.ndarray]:
        result = self.app.coordinator.pull("", 0, timeout=60.0)
        return result.version, np.array(result.weights)  # writable: torch reads it


class _Rows:
    """What an ``Observer`` needs of a stub: row pulls, here answered in process."""

    def __init__(self, app: ServerApp):
        self.app = app

    def PullRows(self, request: pb.RowsRequest, timeout: float | None = None) -> pb.RowsResponse:  # noqa: N802
        return self.app.read_rows(request)


class ServerEvaluation:
    """The thread that evaluates a server's model after each epoch (see the module)."""

    def __init__(self, app: ServerApp, planned: Planned, retry: float = RETRY_SECONDS):
        self.app, self.c, self.planned, self.retry = app, app.coordinator, planned, retry
        self.report = EpochReport(planned.run, planned.job, InProcess(app))
        self._stop = threading.Event()
        self.finished = threading.Event()  # the last epoch evaluated, summary.json written
        self._last: pb.StatusResponse | None = None  # the last epoch's status, once recorded
        self._failure: str | None = None  # the last failure, said by ``unfinished``
        self._thread = threading.Thread(target=self._run, name="ps-evaluation", daemon=True)

    def start(self) -> ServerEvaluation:
        job = self.planned.job
        if job.specs:
            observer = Observer(_Rows(self.app), "this server")
            attach_tables(job.model, RemoteTables([observer], job.specs, rpc_timeout=60))
        self._thread.start()
        return self

    def wait(self, timeout: float) -> bool:
        """Whether the thread has ended within ``timeout`` seconds: after the run's last
        evaluation and summary, or at once for a run already recorded."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop after the evaluation in progress, if any (at most ``timeout`` seconds)."""
        self._stop.set()
        self.c.notify()
        self._thread.join(timeout)

    def unfinished(self) -> str | None:
        """For a run that is over (every batch applied): why its summary.json is not
        written, in a sentence; None once it is, or while the run goes on."""
        q = self.c.queue
        if self.finished.is_set() or q is None or not q.finished:
            return None
        summary = self.planned.run.file("summary.json")
        if self._failure is None:  # still evaluating the last epoch: slow, not failing
            return (
                f"The run is over but its last evaluation had not ended: {summary} is not written."
            )
        return (
            f"The run is over but {summary} was not written ("
            f"{self.c.counters.evaluation_failures} evaluation failures, the last: "
            f"{self._failure}); the log has each one."
        )

    def _run(self) -> None:
        evaluated: int | None = None
        while not self._stop.is_set():
            try:
                if evaluated is None:
                    evaluated = self._already()
                if self._last is not None:  # recorded: only curve.png and summary.json to go
                    self._finish(self._last)
                    continue
                due = self._due(evaluated)
                if due is not None:
                    epoch, last = due
                    recorded = self._record(epoch)
                    evaluated = epoch  # recorded once: a failure after this never records again
                    self._failure = None
                    if last:
                        self._last = recorded.status
            except Exception as exc:  # counted, logged and tried again: never a silent end
                self._failure = f"{type(exc).__name__}: {exc}"
                self.c.counters.evaluation_failures += 1
                what = (
                    "writing curve.png and summary.json"
                    if self._last is not None
                    else f"the evaluation after epoch {(evaluated or 0) + 1}"
                )
                log.exception(
                    "%s failed (%d failures); trying again in %.0fs",
                    what,
                    self.c.counters.evaluation_failures,
                    self.retry,
                )
                self._stop.wait(self.retry)

    def _record(self, epoch: int) -> Recorded:
        """Evaluate after ``epoch``: its line of metrics.jsonl and the status' figures."""
        recorded = self.report.record(epoch)
        acc, loss, area, perplexity = recorded.evaluation
        nan = math.nan
        self.c.counters.tested = Tested(
            epoch,
            acc,
            loss,
            nan if area is None else area,
            nan if perplexity is None else perplexity,
        )
        return recorded

    def _finish(self, st: pb.StatusResponse) -> None:
        """The run's end: curve.png and summary.json (from the lines recorded), then stop."""
        self.report.finish(self.planned.config, st)
        log.info("run finished: summary in %s", self.planned.run.file("summary.json"))
        self.finished.set()
        self._stop.set()

    def _already(self) -> int:
        """Epochs already in the run folder, or applied before a resume: not evaluated again."""
        cfg = self.planned.config
        st = self.c.status().to_proto()
        done = [int(m.get("epoch", 0)) for m in self.planned.run.read_metrics()]
        return max([self.report.resumed(st, cfg.epochs, cfg.checkpoint_dir or ""), *done])

    def _due(self, evaluated: int) -> tuple[int, bool] | None:
        """Waits (a second at most) for an epoch past ``evaluated`` to be applied; returns it
        and whether it is the run's last (then once every accepted push is published), or
        None."""
        found: list[tuple[int, bool]] = []

        def due(c: Coordinator) -> bool:
            q = c.queue
            if self._stop.is_set() or q is None or q.per_epoch < 1:
                return self._stop.is_set()
            if q.finished:
                if q.epochs > evaluated and c.applies.idle:
                    found.append((q.epochs, True))
                return bool(found) or q.epochs <= evaluated
            epoch = q.done // q.per_epoch
            if epoch > evaluated:
                found.append((epoch, False))
            return bool(found)

        self.c.wait_for(due, timeout=1.0)
        if not found and not self._stop.is_set() and self._over(evaluated):
            if self._summarised():
                self.finished.set()  # a finished run already recorded: nothing to do
                self._stop.set()
            elif self.c.applies.idle:  # its summary failed before a restart: written now
                self._last = self.c.status().to_proto()
        return found[0] if found else None

    def _summarised(self) -> bool:
        """Whether summary.json is this run's: of as many epochs as its plan now holds (a
        run restarted with more --epochs, whose new summary failed, keeps the old one)."""
        try:
            summary = json.loads(self.planned.run.file("summary.json").read_text())
        except (OSError, ValueError):
            return False  # none, or unreadable: written (again)
        q = self.c.queue
        return isinstance(summary, dict) and q is not None and summary.get("epochs") == q.epochs

    def _over(self, evaluated: int) -> bool:
        q = self.c.queue
        return q is not None and q.finished and q.epochs <= evaluated
