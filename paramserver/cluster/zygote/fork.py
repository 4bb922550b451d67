"""The zygote's side: serve fork requests on every connection, report exits, and in a
child become the fresh ``python -m paramserver ARGS`` it was asked for.

Each child gets its own connection back to the zygote (``INHERITED``), so that a child
that starts children itself (``launch``) forks them from the same zygote. When a
connection ends (its process exited or was killed), the children started through it that
asked to die with their parent (``PARAMSERVER_PARENT_PID``) are sent SIGTERM, as
PR_SET_PDEATHSIG would have done for an exec'd child; when the first connection (the one
that started the zygote) ends, the zygote exits.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

PARENT_ENV = "PARAMSERVER_PARENT_PID"  # procs.die_with_parent_if_asked reads it
MAX_MESSAGE = 1 << 20
_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_BIND, _MS_REC, _MS_SLAVE, _MNT_DETACH = 4096, 16384, 1 << 19, 2
# In a child: its connection to the zygote that forked it (None in any other process).
INHERITED: socket.socket | None = None
_BASE_PATH: list[str] = []  # the zygote's sys.path without its own folder and PYTHONPATH
_MODULE = "paramserver"  # in a child: what it runs as __main__


def send(sock: socket.socket, note: dict[str, Any], fds: Sequence[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(note).encode()], list(fds))


def _answer(conn: socket.socket, note: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send, unless the caller is gone (its end's EOF comes next)."""
    with contextlib.suppress(OSError):
        send(conn, note, fds)


class _Zygote:
    def __init__(self, root: socket.socket):
        self.root = root
        self.sel = selectors.DefaultSelector()
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        self.wake_w = wake_w
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        self.started: dict[socket.socket, list[tuple[int, bool]]] = {}  # pid, dies with it
        self.owner: dict[int, socket.socket] = {}
        self._open(root)

    def _open(self, conn: socket.socket) -> None:
        self.started[conn] = []
        self.sel.register(conn, selectors.EVENT_READ)

    def serve(self) -> dict[str, Any]:
        """Returns only in a child: its request."""
        while True:
            for key, _ in self.sel.select():
                if key.fileobj == self.wake_r:
                    os.read(self.wake_r, 4096)
                    self._reap()
                    continue
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                try:
                    msg, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
                except OSError:
                    msg, fds = b"", []
                if not msg:
                    self._closed(conn)
                    continue
                try:
                    request = json.loads(msg)
                    _check(request, fds)
                    child = self._fork(conn, request, fds)
                except (ValueError, KeyError, TypeError, OSError) as exc:
                    for fd in fds:
                        os.close(fd)
                    _answer(conn, {"error": f"bad request: {exc!r}"})
                    continue
                if child is not None:
                    return child

    def _fork(
        self, conn: socket.socket, request: dict[str, Any], fds: list[int]
    ) -> dict[str, Any] | None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        zygote = os.getpid()  # the parent the child watches, even if it dies before it looks
        try:
            pid = os.fork()
        except OSError as exc:
            pid = -1
            _answer(conn, {"error": f"fork: {exc}"})
        if pid == 0:
            global INHERITED
            for c in list(self.started):
                c.close()
            self.sel.close()
            signal.set_wakeup_fd(-1)
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            mine.close()
            INHERITED = theirs
            try:
                _become(request, fds, zygote)
            except BaseException:  # noqa: BLE001 - the child must never serve as a zygote
                traceback.print_exc()
                os._exit(1)
            return request
        theirs.close()
        for fd in fds:
            os.close(fd)
        if pid < 0:
            mine.close()
            return None
        self._open(mine)
        self.started[conn].append((pid, PARENT_ENV in request["env"]))
        self.owner[pid] = conn
        pidfd = os.pidfd_open(pid)
        _answer(conn, {"pid": pid, "args": request["args"]}, [pidfd])
        os.close(pidfd)
        return None

    def _closed(self, conn: socket.socket) -> None:
        """The process at the other end exited: its children that asked die with it."""
        self.sel.unregister(conn)
        conn.close()
        for pid, dies in self.started.pop(conn):
            if dies and self.owner.get(pid) is conn:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        if conn is self.root:
            os._exit(0)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.owner.pop(pid, None)
            if conn is not None and conn in self.started:
                self.started[conn] = [s for s in self.started[conn] if s[0] != pid]
                _answer(conn, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "module": str,
    "args": list,
    "env": dict,
    "cwd": str,
    "session": bool,
    "netns": (str, type(None)),
    "ignored": list,
}


def _check(request: object, fds: list[int]) -> None:
    if not isinstance(request, dict) or len(fds) != 3:
        raise ValueError("a request is a JSON object and three descriptors")
    for key, kind in _FIELDS.items():
        if not isinstance(request.get(key), kind):
            raise ValueError(f"{key!r} is missing or not {kind}")
    if not all(isinstance(a, str) for a in request["args"]) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in request["env"].items()
    ):
        raise ValueError("args and env hold strings")
    if not all(type(s) is int and 0 < s < signal.NSIG for s in request["ignored"]):
        raise ValueError("ignored holds signal numbers")


def _become(request: dict[str, Any], fds: list[int], zygote: int) -> None:
    """In the forked child of ``zygote`` (its pid): the state a fresh ``python -m
    paramserver ARGS`` exec'd by the caller would have, the signals the caller ignores
    ignored."""
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in request["ignored"]:
        with contextlib.suppress(OSError, ValueError):  # one this platform cannot set
            signal.signal(sig, signal.SIG_IGN)
    if request["session"]:
        os.setsid()
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    sys.stderr = _text_out(2, True)  # what goes wrong from here is the child's to say
    if request["netns"]:
        _enter_netns(request["netns"])
    env = request["env"]
    if PARENT_ENV in env:  # the zygote is the parent it can watch (gone: it dies at once)
        env[PARENT_ENV] = str(zygote)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout, sys.stderr = (_text_out(fd, unbuffered) for fd in (1, 2))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *_BASE_PATH]
    importlib.invalidate_caches()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()  # a fresh interpreter's seed is its own
    sys.argv = ["-m", *request["args"]]
    global _MODULE
    _MODULE = request["module"]


def _enter_netns(name: str) -> None:
    """What ``ip netns exec NAME`` does before it execs: join the network namespace and, in
    a mount namespace of its own, bind /etc/netns/NAME/* over /etc (the hosts file that
    names the other hosts) and mount the namespace's /sys."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(ctypes.get_errno(), f"{what} for network namespace {name}")

    ns = os.open(f"/run/netns/{name}", os.O_RDONLY)
    check(libc.setns(ns, _CLONE_NEWNET), "setns")
    os.close(ns)
    check(libc.unshare(_CLONE_NEWNS), "unshare")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    if libc.umount2(b"/sys", _MNT_DETACH) == 0:
        check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount /sys")
    etc = f"/etc/netns/{name}"
    for entry in sorted(os.listdir(etc)) if os.path.isdir(etc) else []:
        source, target = f"{etc}/{entry}".encode(), f"/etc/{entry}".encode()
        check(libc.mount(source, target, b"none", _MS_BIND, None), f"bind {etc}/{entry}")


def _text_out(fd: int, unbuffered: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, write_through=True, errors="backslashreplace")
    return io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=raw.isatty())


def run_child() -> int:
    """The module asked for (``paramserver``) as ``__main__``, and the exit an interpreter makes: its code,
    non-daemon threads joined, atexit functions run, streams flushed. Module teardown is
    skipped (it would copy every page shared with the zygote)."""
    try:
        runpy.run_module(_MODULE, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - printed as the interpreter would
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if code < 0:  # died of a signal, as an uncaught KeyboardInterrupt does
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def main(fd: int, preload: Sequence[str]) -> None:
    """The zygote: import ``preload``, then serve the connection ``fd`` (and its children's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's ^C is for the children
    own = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE_PATH[:] = [p for p in sys.path[1:] if p not in own]
    for name in preload:
        importlib.import_module(name)
    gc.freeze()  # the children's collections skip (and do not copy) the zygote's objects
    _Zygote(socket.socket(fileno=fd)).serve()
    os._exit(run_child())
