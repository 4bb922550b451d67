"""Child processes of the launcher and of ``worker --procs``: start, watch, always reap."""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from paramserver.cluster.zygote import Forked, Zygote, ZygoteLost, fork
from paramserver.errors import ParamServerError, Timeout

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
_PARENT_ENV = fork.PARENT_ENV  # the zygote rewrites it to itself in its children
# What `paramserver server` prints on stdout, then its address, once it serves.
READY_MARKER = "paramserver server listening on"
_NETNS_EXEC = ["ip", "netns", "exec"]
_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def shared_zygote() -> Zygote | None:
    """This process's zygote: the one that forked it, or one started on first use (again
    if it died); None where none can start (then children are exec'd)."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.lost:
            if _zygote is not None:
                log.warning("%s; starting another", _zygote.lost)
            inherited, fork.INHERITED = fork.INHERITED, None  # forked by one: use it
            try:
                _zygote = Zygote(sock=inherited) if inherited else Zygote()
            except OSError as exc:
                log.warning("no zygote (%s): children start as fresh interpreters", exc)
                return None
        return _zygote


def die_with_parent_if_asked() -> None:
    """In a child of Child: get SIGTERM when the parent dies, even by kill -9 (Linux).

    Done by the child itself at start-up rather than in a preexec_fn, which is unsafe in
    a parent that runs threads.
    """
    parent = os.environ.pop(_PARENT_ENV, None)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def start(argv: Sequence[str], fork: bool = True, **popen: Any) -> subprocess.Popen | Forked:
    """``subprocess.Popen(argv, **popen)``; forked from this process's zygote instead when
    ``argv`` is ``[ip netns exec NS] PYTHON -m MODULE ARGS`` with this interpreter (and
    ``fork``). ``popen`` as ``Zygote.popen`` takes it (stdin, stdout, stderr, env, cwd,
    start_new_session, text)."""
    netns = None
    rest = list(argv)
    if rest[:3] == _NETNS_EXEC and len(rest) > 3:
        netns, rest = rest[3], rest[4:]
    zygote = shared_zygote() if fork and rest[:2] == [sys.executable, "-m"] else None
    if zygote is not None and len(rest) > 2:
        try:
            return zygote.popen(rest[3:], module=rest[2], netns=netns, **popen)
        except ZygoteLost as exc:
            log.warning("%s: starting %s as a fresh interpreter", exc, rest[2:4])
    return subprocess.Popen(list(argv), **popen)


def run(
    argv: Sequence[str], timeout: float, capture: bool = True, **popen: Any
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=capture, text=True, timeout=timeout, ...)``
    through ``start``: killed on ``timeout`` (then TimeoutExpired)."""
    pipe = subprocess.PIPE if capture else popen.pop("stdout", None)
    err = subprocess.PIPE if capture else popen.pop("stderr", None)
    with start(argv, stdout=pipe, stderr=err, text=True, **popen) as proc:
        try:
            out, errs = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(list(argv), proc.wait(), out, errs)


class Child:
    """One child process running ``python -m paramserver ...``, logging to a file."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_path: Path,
        capture_stdout: bool = False,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
        tee: Callable[[str], None] | None = None,
        fork: bool = True,
    ):
        """``prefix``: a command that runs the rest in place (it must exec it, keeping its
        pid: ``ip netns exec NS``). ``tee``: also hand every line the child writes (stdout
        and stderr) to it, as it comes (``worker --procs`` shows them on the terminal).
        ``fork``: fork it from the shared zygote (no prefix or ``ip netns exec``) rather
        than exec a fresh interpreter, which spends seconds of CPU on imports."""
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in reap()
        env = dict(
            os.environ, **(env or {}), PYTHONUNBUFFERED="1", **{_PARENT_ENV: str(os.getpid())}
        )
        self._write = threading.Lock()  # two tee threads write the one log
        piped = subprocess.PIPE if tee is not None else self._log
        self.proc = start(
            [*prefix, sys.executable, "-m", "paramserver", *args],
            fork,
            stdin=subprocess.DEVNULL,
            env=env,
            stdout=subprocess.PIPE if capture_stdout else piped,
            stderr=piped,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._tees: list[threading.Thread] = []
        if capture_stdout:
            threading.Thread(target=self._read_stdout, daemon=True, name=f"{name}-stdout").start()
        elif tee is not None:
            self._tees = [
                threading.Thread(target=self._tee, args=(pipe, tee), daemon=True, name=name)
                for pipe in (self.proc.stdout, self.proc.stderr)
            ]
            for t in self._tees:
                t.start()

    def _tee(self, pipe: Any, tee: Callable[[str], None]) -> None:
        for raw in pipe:
            with self._write:
                self._log.write(raw)
                self._log.flush()
            try:
                tee(raw.decode(errors="replace").rstrip("\n"))
            except Exception:  # noqa: BLE001 - the terminal's trouble must not stop the log
                log.exception("showing %s's line failed", self.name)

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until every line the (exited) child wrote has been logged and teed."""
        for t in self._tees:
            t.join(timeout)

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            self._log.write(raw)
            self._log.flush()
            self._lines.put(line)
        self._lines.put(None)

    def wait_for_line(self, marker: str, timeout: float) -> str:
        """The first stdout line containing ``marker``.

        Raises:
            ParamServerError: the child exited first (its log tail is in the message).
            Timeout: no such line within ``timeout`` seconds.
        """
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise Timeout(
                    f"{self.name} printed no '{marker}' line within {timeout:.0f}s; see {self.log_path}."
                ) from None
            if line is None:
                self.proc.wait()
                raise ParamServerError(
                    f"{self.name} exited with code {self.proc.returncode} before it was ready: "
                    f"{self.tail()}"
                )
            if marker in line:
                return line.strip()

    def tail(self, lines: int = 1) -> str:
        """The last lines of the child's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return f"(no log at {self.log_path})"
        return " | ".join(text[-lines:]) if text else f"(empty log {self.log_path})"

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after ``grace`` seconds; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs of SIGTERM; killing it", self.name, grace)
                self.proc.kill()
        code = self.proc.wait()
        self._log.close()
        return code


def stop_all(children: Sequence[Child], grace: float = 5.0) -> None:
    """Stop every child that is still running."""
    for child in children:
        if child.poll() is None:
            child.proc.terminate()
    for child in children:
        child.stop(grace)
