"""``paramserver worker --procs N``: N single-process workers on this host, as torchrun
runs its ranks.

Every line a process writes goes to the terminal with its prefix (``[proc i]`` until the
server gave it a rank, then ``[rank R]``) and to its log file, which is renamed ``rank-R.log``
once the rank is known (``proc-i.log`` before). At the end one line a process says how it
ended (its steps, samples and time, from the JSON line a worker prints last, or its exit
code and last line), and the exit status is 1 if any process failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from paramserver import settings
from paramserver.cluster.commands import CHILD_ENV, worker_command
from paramserver.cluster.procs import Child, stop_all
from paramserver.config import WorkerConfig

log = logging.getLogger(__name__)

# the worker's join line: "joined ADDRESS as ID (rank R of N) ..."
JOINED = re.compile(r"joined \S+ as \S+ \(rank (\d+) of \d+\)")


class Shown:
    """One process's lines: to the terminal with its prefix, and its rank once it joined
    (its log renamed to match); its last JSON line (the worker's summary)."""

    def __init__(self, index: int, logdir: Path, out: Any = None):
        self.index, self.logdir = index, logdir
        self.out = out or sys.stderr
        self.rank: int | None = None
        self.summary: dict[str, Any] | None = None
        self.child: Child | None = None
        self._lock = threading.Lock()

    @property
    def prefix(self) -> str:
        return f"[proc {self.index}]" if self.rank is None else f"[rank {self.rank}]"

    def path(self) -> Path:
        name = f"proc-{self.index}.log" if self.rank is None else f"rank-{self.rank}.log"
        return self.logdir / name

    def __call__(self, line: str) -> None:
        with self._lock:
            joined = JOINED.search(line)
            if joined and self.rank is None:
                self._ranked(int(joined.group(1)))
            if line.startswith("{"):
                with contextlib.suppress(ValueError):  # a line that only looks like JSON
                    self.summary = json.loads(line)
            print(f"{self.prefix} {line}", file=self.out, flush=True)

    def _ranked(self, rank: int) -> None:
        """The server gave this process ``rank``: its log becomes ``rank-R.log``."""
        before = self.path()
        self.rank = rank
        after = self.path()
        try:
            os.rename(before, after)  # the open file goes on being written, under its name
            if self.child is not None:
                self.child.log_path = after
        except OSError as exc:
            log.warning("cannot rename %s to %s: %s", before, after, exc)

    def ended(self, code: int) -> str:
        """The line that says how the process ended."""
        s = self.summary
        if code == 0 and s is not None:
            return (
                f"{self.prefix} done: {s.get('steps', 0)} steps, {s.get('samples', 0)} samples "
                f"in {float(s.get('seconds', 0.0)):.1f}s"
            )
        tail = self.child.tail() if self.child is not None else ""
        return f"{self.prefix} exited with code {code}: {tail}"


def run_worker_procs(cfg: WorkerConfig, procs: int, out: Any = None) -> int:
    """Start ``procs`` single-process workers here, show their lines as they come, wait for
    all of them and summarise; the exit status (1 if any failed)."""
    from paramserver.training.trainer import process_devices

    devices = process_devices(cfg.device, procs, torch.cuda.device_count())
    logdir = Path(tempfile.mkdtemp(prefix="paramserver-workers-"))
    shown = [Shown(i, logdir, out) for i in range(procs)]
    children: list[Child] = []
    try:
        for i, s in enumerate(shown):
            one = dataclasses.replace(
                cfg, device=devices[i], name=f"{cfg.name or os.uname().nodename}-{i}"
            )
            env = {**settings.secrets(cfg), **CHILD_ENV}  # the token by the environment
            child = Child(f"proc-{i}", worker_command(one), s.path(), env=env, tee=s)
            s.child = child
            children.append(child)
        log.info("started %d worker processes; logs in %s", procs, logdir)
        worst = 0
        for s, child in zip(shown, children, strict=True):
            code = child.proc.wait()
            child.drain()
            print(s.ended(code), file=s.out, flush=True)
            worst = worst or (1 if code != 0 else 0)
        failed = sum(1 for c in children if c.proc.returncode != 0)
        total = sum(int((s.summary or {}).get("samples", 0)) for s in shown)
        print(
            f"{procs} worker processes: {procs - failed} done, {failed} failed; "
            f"{total} samples in all; logs in {logdir}",
            file=out or sys.stderr,
            flush=True,
        )
        return worst
    finally:
        stop_all(children)
