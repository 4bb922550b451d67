"""The zygote forks ``python -m paramserver`` children that behave as exec'd ones: their
streams, environment, folder, exit codes and signals, their death with their parent, and a
clear end when the zygote itself dies."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from paramserver.cluster import procs
from paramserver.cluster.zygote import Forked, Zygote, ZygoteLost, fork
from tests.conftest import DEADLINE, paramserver_run, wait_until

pytestmark = pytest.mark.timeout(300)
PROBE = """
import json, os, signal, sys, numpy.random
print(json.dumps({
    "cwd": os.getcwd(), "path": sys.path[:2], "argv": sys.argv[1:],
    "draw": int(numpy.random.randint(1 << 30)), "env": os.environ.get("PROBE_VALUE"),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sighup_ignored": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
    "ppid": os.getppid(),
}))
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


def _alive(pid: int) -> bool:
    """Running (a zombie or a reaped pid is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _zygote() -> Zygote:
    zygote = procs.shared_zygote()
    assert zygote is not None
    return zygote


@pytest.fixture
def probe_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "probe.py").write_text(PROBE)
    return {**os.environ, "PYTHONPATH": str(tmp_path / "mine"), "PROBE_VALUE": "seen"}


def _probe(
    zygote: Zygote, env: dict[str, str], cwd: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    with zygote.popen(
        args, module="probe", env=env, cwd=cwd, stdout=subprocess.PIPE, text=True
    ) as proc:
        out, _ = proc.communicate(DEADLINE)
    return subprocess.CompletedProcess(list(args), proc.returncode, out)


def test_a_forked_child_has_what_an_exec_would_give_it(
    tmp_path: Path, probe_env: dict[str, str]
) -> None:
    exec_run = subprocess.run(
        [sys.executable, "-m", "probe", "a", "b"],
        env=probe_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    execd = json.loads(exec_run.stdout)
    zygote = Zygote(preload=("numpy.random",))  # its children inherit numpy's global RNG
    try:
        forked = [json.loads(_probe(zygote, probe_env, tmp_path, "a", "b").stdout) for _ in "12"]
        for got in forked:
            for key in ("cwd", "path", "argv", "env", "sigint"):
                assert got[key] == execd[key], key
            assert got["ppid"] == zygote.proc.pid  # type: ignore[union-attr]
        assert forked[0]["draw"] != forked[1]["draw"], "two children drew the same numbers"
        assert _probe(zygote, {**probe_env, "PROBE_EXIT": "3"}, tmp_path).returncode == 3
    finally:
        zygote.close()


@pytest.mark.parametrize("ignored", [(), (signal.SIGHUP, signal.SIGINT)])
def test_a_forked_child_ignores_the_signals_its_caller_ignores(
    tmp_path: Path, probe_env: dict[str, str], ignored: tuple[int, ...]
) -> None:
    """As across an exec: a launcher under ``nohup`` (SIGHUP) or run as a background job
    (SIGINT) has children that ignore them too; the forked ones did not."""
    # both set either way: a suite run under nohup, or as a background job, ignores them
    handlers = {signal.SIGHUP: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    was = {
        sig: signal.signal(sig, signal.SIG_IGN if sig in ignored else h)
        for sig, h in handlers.items()
    }
    try:
        command = [sys.executable, "-m", "probe"]
        execd = json.loads(
            subprocess.run(command, env=probe_env, cwd=tmp_path, capture_output=True).stdout
        )
        forked = json.loads(_probe(_zygote(), probe_env, tmp_path).stdout)
    finally:
        for sig, handler in was.items():
            signal.signal(sig, handler)
    assert execd["sighup_ignored"] == bool(ignored) and execd["sigint"] != bool(ignored)
    assert (forked["sighup_ignored"], forked["sigint"]) == (
        execd["sighup_ignored"],
        execd["sigint"],
    )


def test_a_child_whose_zygote_died_before_it_looked_dies_too() -> None:
    """The zygote killed between its fork and the child's start-up: the child's parent is
    another process by then, and it must not take that one for the zygote it watches."""
    null = os.open(os.devnull, os.O_RDWR)
    request = {"module": "paramserver", "args": [], "env": {fork.PARENT_ENV: "1"},
               "cwd": os.getcwd(), "session": False, "netns": None, "ignored": []}  # fmt: skip
    gone = subprocess.Popen(["true"])  # a pid no longer running: the dead zygote's
    gone.wait()
    pid = os.fork()
    if pid == 0:  # the child as the zygote forks it, its parent already someone else
        try:
            fork._become(request, [null, os.dup(null), os.dup(null)], gone.pid)
            procs.die_with_parent_if_asked()
        finally:
            os._exit(0)
    os.close(null)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGTERM


def test_paramserver_commands_exit_and_print_as_after_an_exec(tmp_path: Path) -> None:
    env = {**os.environ, "PARAMSERVER_LR": "0.25"}
    done = paramserver_run("server", "--print-config", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "lr = 0.25" in done.stdout
    bad = paramserver_run("no-such-command")
    assert bad.returncode == 2 and "No such command" in bad.stderr and bad.stdout == ""
    merged = _zygote().popen(
        ["no-such-command"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out, _ = merged.communicate(DEADLINE)
    assert "No such command" in out and merged.returncode == 2


def test_signals_reach_the_child_and_its_death_is_reported(tmp_path: Path) -> None:
    server = procs.Child("server", ["server", "--port", "0"], tmp_path / "s.log", True)
    try:
        server.wait_for_line(procs.READY_MARKER, DEADLINE)
        os.kill(server.proc.pid, signal.SIGSTOP)  # the pid is the process itself
        wait_until(lambda: _state(server.proc.pid) == "T", "stopped")
        os.kill(server.proc.pid, signal.SIGCONT)
        server.proc.kill()
        assert server.proc.wait(DEADLINE) == -signal.SIGKILL
        server.proc.kill()  # after its exit: no error, and no other process is hit
    finally:
        server.stop()
    term = procs.Child("server", ["server", "--port", "0"], tmp_path / "t.log", True)
    term.wait_for_line(procs.READY_MARKER, DEADLINE)
    assert term.stop() in (0, -signal.SIGTERM)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


HOLDER = """
import sys
from pathlib import Path
from paramserver.cluster import procs
child = procs.Child("server", ["server", "--port", "0"], Path(sys.argv[1]), True)
child.wait_for_line(procs.READY_MARKER, 120)
nested = procs.Child("launcher", ["--help"], Path(sys.argv[1] + ".help"))
print(child.proc.pid, procs.shared_zygote().proc.pid, flush=True)
sys.stdin.read()
"""


def test_children_die_with_a_parent_killed_with_sigkill(tmp_path: Path) -> None:
    """The holder's zygote exits when the holder dies, and the server it forked (which
    asked to die with its parent) gets SIGTERM."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "server.log")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        server_pid, zygote_pid = map(int, holder.stdout.readline().split())
        assert _alive(server_pid) and _alive(zygote_pid)
        holder.kill()
        holder.wait(DEADLINE)
        wait_until(lambda: not _alive(server_pid), "the server gone with its parent")
        wait_until(lambda: not _alive(zygote_pid), "the zygote gone with its caller")
    finally:
        holder.kill()
        holder.wait(DEADLINE)


NESTED = """
import subprocess, sys
from pathlib import Path
from paramserver.cluster import procs
from paramserver.cluster.zygote import fork
inherited = fork.INHERITED is not None
server = procs.Child("server", ["server", "--port", "0"], Path(sys.argv[1]), True)
server.wait_for_line(procs.READY_MARKER, 120)
print(inherited, procs.shared_zygote().proc is None, server.proc.pid, flush=True)
sys.stdin.read()
"""


def test_a_forked_child_forks_its_children_from_the_same_zygote(tmp_path: Path) -> None:
    """A launcher forked from the zygote starts its server through it, and when the
    launcher is killed with SIGKILL, its server (a sibling now) gets SIGTERM all the same."""
    (tmp_path / "nested.py").write_text(NESTED)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    launcher = _zygote().popen(
        [str(tmp_path / "s.log")],
        module="nested",
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        inherited, own_zygote, pid = launcher.stdout.readline().split()
        assert (inherited, own_zygote) == ("True", "True")
        assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(
            _zygote().proc.pid  # type: ignore[union-attr]
        )
        launcher.kill()
        assert launcher.wait(DEADLINE) == -signal.SIGKILL
        wait_until(lambda: not _alive(int(pid)), "the server gone with its launcher")
    finally:
        launcher.kill()


def test_a_dead_zygote_is_told_to_every_waiter_and_replaced(tmp_path: Path) -> None:
    zygote = Zygote(preload=())
    try:
        env = {**os.environ, fork.PARENT_ENV: str(os.getpid())}  # dies with the zygote
        child = zygote.popen(["server", "--port", "0"], env=env, stdout=subprocess.PIPE)
        assert zygote.proc is not None
        zygote.proc.kill()
        assert child.wait(DEADLINE) == -signal.SIGKILL  # its exit code is lost: said so
        wait_until(lambda: zygote.lost is not None, "the zygote's death seen")
        assert "exited with code -9" in str(zygote.lost)
        with pytest.raises(ZygoteLost, match="exited with code -9"):
            zygote.popen(["--help"])
        wait_until(lambda: not _alive(child.pid), "the child gone with its zygote")
    finally:
        zygote.close()


def test_a_malformed_request_is_refused_and_the_zygote_goes_on() -> None:
    """A child holds a connection to the zygote; what it sends there cannot break it."""
    zygote = Zygote(preload=())
    try:
        sock = zygote._sock
        null = os.open(os.devnull, os.O_RDWR)
        for junk, fds in ((b"not json", [null] * 3), (b"[1]", [null] * 3), (b"{}", [null])):
            with zygote._lock, zygote._replied:
                socket.send_fds(sock, [junk], fds)
                zygote._replied.wait_for(lambda: zygote._replies, timeout=DEADLINE)
                assert "bad request" in str(zygote._replies.pop(0))
        os.close(null)
        wait = zygote.popen(["--help"], stdout=subprocess.DEVNULL)
        assert wait.wait(DEADLINE) == 0
    finally:
        zygote.close()
    assert fork.INHERITED is None  # only a forked child holds one


def test_a_request_the_child_cannot_set_up_fails_the_child_alone(tmp_path: Path) -> None:
    zygote = _zygote()
    gone = zygote.popen(["--help"], cwd=tmp_path / "missing", stderr=subprocess.PIPE, text=True)
    _, err = gone.communicate(DEADLINE)
    assert gone.returncode == 1 and "FileNotFoundError" in err
    assert zygote.popen(["--help"], stdout=subprocess.DEVNULL).wait(DEADLINE) == 0


def test_the_zygote_adds_no_thread_and_no_listening_socket() -> None:
    zygote = _zygote()
    assert zygote.proc is not None
    pid = zygote.proc.pid
    wait_until(lambda: Path(f"/proc/{pid}/task").exists(), "the zygote up")
    zygote.popen(["--help"], stdout=subprocess.DEVNULL).wait(DEADLINE)  # it has preloaded
    assert len(os.listdir(f"/proc/{pid}/task")) == 1
    links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    inodes = {link[len("socket:[") : -1] for link in links if link.startswith("socket:")}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()  # Num RefCount Protocol Flags Type St Inode Path
        if fields[6] in inodes:
            assert fields[3] != "00010000", f"the zygote listens: {line}"


def test_communicate_goes_on_after_a_timeout_as_popen_s_does(tmp_path: Path) -> None:
    """What the first call's readers read before its timeout is in the second's result."""
    server = _zygote().popen(
        ["server", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert server.stdout is not None
        assert procs.READY_MARKER in server.stdout.readline()
        with pytest.raises(subprocess.TimeoutExpired):
            server.communicate(timeout=0.3)
    finally:
        server.terminate()
    _, err = server.communicate(timeout=DEADLINE)
    assert "server configuration" in err and "SIGTERM received" in err
    assert server.returncode == 0


NETNS_PROBE = """
import json, os, socket
print(json.dumps({"peer": socket.gethostbyname("b"), "links": sorted(os.listdir("/sys/class/net"))}))
"""


@pytest.mark.xdist_group("netns")
def test_a_child_forked_into_a_network_namespace_sees_what_ip_netns_exec_gives(
    tmp_path: Path,
) -> None:
    """The namespace's hosts file (host names of the other hosts) and its own /sys."""
    from paramserver.cluster import netns

    if (why := netns.unavailable()) is not None:
        pytest.skip(why)
    (tmp_path / "nsprobe.py").write_text(NETNS_PROBE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    with netns.Network(["a", "b"]) as net:
        argv = net.argv("a", [sys.executable, "-m", "nsprobe"])
        execd = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=DEADLINE)
        forked = procs.run(argv, DEADLINE, env=env)
        with procs.start(argv, stdout=subprocess.DEVNULL, env=env) as child:
            assert isinstance(child, Forked)  # it did fork
    assert execd.returncode == 0 and forked.returncode == 0, (execd.stderr, forked.stderr)
    assert json.loads(forked.stdout) == json.loads(execd.stdout)
    assert json.loads(forked.stdout)["peer"] == net.addr["b"]
