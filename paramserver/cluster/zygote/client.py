"""The caller's end of the zygote: ``Zygote.popen`` starts ``python -m paramserver ARGS``
by a fork of it and hands back a ``Forked``, used as a ``subprocess.Popen`` is."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from paramserver.cluster.zygote import fork
from paramserver.errors import ParamServerError

log = logging.getLogger(__name__)
# What every child of the launcher and of the tests needs; the caller may add more.
PRELOAD = ("torch", "numpy", "grpc", "paramserver.server.app", "paramserver.training.trainer")


# subprocess sets these back to SIG_DFL before it execs (restore_signals); Python ignores
# SIGPIPE and SIGXFSZ again at start-up, as the zygote's children already do
_RESTORED = {getattr(signal, n) for n in ("SIGPIPE", "SIGXFZ", "SIGXFSZ") if hasattr(signal, n)}


def ignored_signals() -> list[int]:
    """The signals this process ignores that an exec'd child would ignore too (a ``nohup``
    launcher's SIGHUP, a background job's SIGINT): a forked child ignores them as well."""
    found = []
    for sig in signal.valid_signals():
        if sig in _RESTORED:
            continue
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                found.append(int(sig))
        except (OSError, ValueError):  # a signal Python does not manage
            continue
    return found


class ZygoteLost(ParamServerError):
    """The zygote exited: no new child can be started through it."""


class Forked:
    """A child forked by the zygote, used like a ``subprocess.Popen``."""

    def __init__(self, pid: int, pidfd: int, args: list[str]):
        self.pid, self.args, self._pidfd = pid, args, pidfd
        self.returncode: int | None = None
        self._done = threading.Event()
        self._signalling = threading.Lock()  # the pidfd is not closed under a signal
        self.stdin: IO[Any] | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        self._readers: list[threading.Thread] | None = None
        self._read_out: dict[str, Any] = {}

    def _exited(self, code: int) -> None:
        with self._signalling:
            self.returncode = code
            os.close(self._pidfd)
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._signalling:
            if self.returncode is None:
                with contextlib.suppress(ProcessLookupError):  # a zombie, not yet reaped
                    signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr (those that are pipes) to their end, then wait; after a
        TimeoutExpired, may be called again (the reading goes on meanwhile)."""
        if self._readers is None:
            self._readers = [
                threading.Thread(target=self._drain, args=(k, f), daemon=True, name=k)
                for k, f in (("out", self.stdout), ("err", self.stderr))
                if f is not None
            ]
            for t in self._readers:
                t.start()
        ends = None if timeout is None else time.monotonic() + timeout
        for t in self._readers:
            t.join(None if ends is None else max(0.0, ends - time.monotonic()))
        if any(t.is_alive() for t in self._readers):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if ends is None else max(0.0, ends - time.monotonic()))
        return self._read_out.get("out"), self._read_out.get("err")

    def _drain(self, key: str, stream: IO[Any]) -> None:
        self._read_out[key] = stream.read()

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


class Zygote:
    """The caller's end: start children, learn their exits."""

    def __init__(self, preload: Sequence[str] = PRELOAD, sock: socket.socket | None = None):
        """A new zygote importing ``preload``; or, with ``sock``, the connection a child of
        a zygote has to it (``fork.INHERITED``)."""
        os.close(os.pidfd_open(os.getpid()))  # OSError where the kernel lacks pidfds
        self.proc: subprocess.Popen | None = None
        if sock is None:
            root = str(Path(__file__).resolve().parents[3])  # where paramserver is
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with theirs:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "paramserver.cluster.zygote", str(theirs.fileno())]
                    + list(preload),
                    stdin=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(),),
                    env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
                )
        self._sock = sock
        self._lock = threading.Lock()  # one spawn at a time: its reply is the next message
        self._replies: list[Forked | str] = []
        self._replied = threading.Condition()
        self._children: dict[int, Forked] = {}
        self.lost: str | None = None
        self._reader = threading.Thread(target=self._read, daemon=True, name="zygote-reader")
        self._reader.start()

    def _read(self) -> None:
        """Replies and exits from the zygote, until it ends (then every waiter is told)."""
        try:
            while True:
                msg, fds, _, _ = socket.recv_fds(self._sock, fork.MAX_MESSAGE, 1)
                if not msg:
                    break
                note = json.loads(msg)
                if "exit" in note:
                    self._children.pop(note["exit"])._exited(note["code"])
                    continue
                reply: Forked | str = note.get("error", "")
                if "pid" in note:
                    reply = Forked(note["pid"], fds[0], note["args"])
                    self._children[reply.pid] = reply
                with self._replied:
                    self._replies.append(reply)
                    self._replied.notify_all()
        except Exception:  # noqa: BLE001 - told to every waiter below, and logged
            log.exception("reading from the zygote failed")
        if self.proc is not None:
            self.lost = f"the zygote (pid {self.proc.pid}) exited with code {self.proc.wait()}"
        else:
            self.lost = "the zygote that forked this process is gone"
        if self._children:
            log.error("%s; its %d children's exit codes are lost", self.lost, len(self._children))
        for child in list(self._children.values()):
            child._exited(-signal.SIGKILL)
        with self._replied:
            self._replied.notify_all()

    def popen(
        self,
        args: Sequence[str],
        *,
        stdin: int | None = subprocess.DEVNULL,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        start_new_session: bool = False,
        netns: str | None = None,
        text: bool = False,
        module: str = "paramserver",
    ) -> Forked:
        """``python -m MODULE ARGS`` forked: the streams as ``subprocess.Popen`` takes
        them (None: the caller's, PIPE, DEVNULL, STDOUT for stderr, a file or a descriptor);
        ``netns``: the network namespace to run it in (``ip netns exec NS``)."""
        streams, ours = _streams(stdin, stdout, stderr)
        request = {
            "module": module,
            "args": list(args),
            "env": dict(os.environ if env is None else env),
            "cwd": str(cwd or os.getcwd()),
            "session": start_new_session,
            "netns": netns,
            "ignored": ignored_signals(),
        }
        try:
            with self._lock:
                if self.lost:
                    raise ZygoteLost(self.lost)
                socket.send_fds(self._sock, [json.dumps(request).encode()], streams)
                with self._replied:
                    self._replied.wait_for(lambda: self._replies or self.lost)
                    if not self._replies:
                        raise ZygoteLost(str(self.lost))
                    reply = self._replies.pop(0)
        except OSError as exc:
            raise ZygoteLost(f"the zygote is gone: {exc}") from exc
        finally:
            for fd in streams:
                os.close(fd)
        if isinstance(reply, str):
            for f in ours.values():
                os.close(f)
            raise ParamServerError(f"the zygote could not start {list(args)}: {reply}")
        mode = "" if text else "b"
        for name, fd in ours.items():
            setattr(reply, name, open(fd, ("w" if name == "stdin" else "r") + mode))  # noqa: SIM115
        return reply

    def close(self) -> None:
        """The connection ends (a zygote this started exits): the children started through
        it that asked to die with their parent get SIGTERM; the others go on."""
        try:
            self._sock.shutdown(socket.SHUT_WR)  # the zygote reads its end, and exits
            if self.proc is not None:
                self.proc.wait(10)
        except OSError:
            pass  # already gone
        except subprocess.TimeoutExpired:
            assert self.proc is not None
            self.proc.kill()
        self._reader.join(10)
        self._sock.close()


def _streams(stdin: Any, stdout: Any, stderr: Any) -> tuple[list[int], dict[str, int]]:
    """The three descriptors the child gets (ours to close after sending) and the caller's
    ends of the pipes asked for."""
    sent: list[int] = []
    ours: dict[str, int] = {}
    for i, (name, how) in enumerate((("stdin", stdin), ("stdout", stdout), ("stderr", stderr))):
        if how == subprocess.PIPE:
            r, w = os.pipe()
            child, mine = (r, w) if i == 0 else (w, r)
            ours[name] = mine
            sent.append(child)
        elif how == subprocess.STDOUT and i == 2:
            sent.append(os.dup(sent[1]))
        elif how == subprocess.DEVNULL:
            sent.append(os.open(os.devnull, os.O_RDWR))
        elif how is None:
            sent.append(os.dup(i))
        else:
            sent.append(os.dup(how if isinstance(how, int) else how.fileno()))
    return sent, ours
