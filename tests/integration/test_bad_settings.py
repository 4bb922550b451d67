"""Settings a server can never run with are refused at start-up in one line, exit 2, before
anything is served: a --checkpoint-dir it cannot make or write, a --workers past what the
wire carries, a --lease-timeout past what the clock waits; and the lease reaper outlives
whatever its pass meets."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import threading
from types import SimpleNamespace

import pytest

from paramserver import cli
from paramserver.cluster.procs import READY_MARKER
from paramserver.config import ServerConfig
from paramserver.errors import ConfigError
from paramserver.server.app import ServerApp
from tests.conftest import DEADLINE, paramserver_run

MAX_INT32 = 2**31 - 1  # the largest an int32 field of the wire carries
LOCAL = {"host": "127.0.0.1", "port": "0", "model": "mlp", "dataset": "synthetic"}


def server_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    flags = [f"--{key}={value}" for key, value in LOCAL.items()]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSERVER_")}
    return paramserver_run("server", *flags, *args, env={**clean, **(env or {})})


def refused(out: subprocess.CompletedProcess) -> str:
    """The one line of a refusal (exit 2, no traceback, nothing served)."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and READY_MARKER not in out.stdout, out.stderr[-3000:]
    assert [line for line in lines if line.startswith("paramserver: error: ")] == lines[-1:]
    return lines[-1]


def test_a_checkpoint_dir_that_is_a_file_is_one_line_and_exit_2():
    out = server_cli("--checkpoint-dir", "/dev/null")  # --run-dir auto: a folder in it
    assert refused(out) == "paramserver: error: --checkpoint-dir /dev/null is not a folder."
    # Refused before its run folder was planned in it: no warning about that one.
    assert "run folder" not in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("{tmp}/a-file/checkpoints", "Not a directory ({tmp}/a-file is not a folder)."),
        ("/proc/self/x", "No such file or directory."),
    ],
)
def test_a_checkpoint_dir_that_cannot_be_made_is_one_line_and_exit_2(
    tmp_path, capsys, monkeypatch, where, why
):
    """The same command in this process (a child costs seconds of imports): the path and
    the operating system's reason."""
    for name in [n for n in os.environ if n.startswith("PARAMSERVER_")]:
        monkeypatch.delenv(name)
    (tmp_path / "a-file").write_text("not a folder")
    path, why = (text.replace("{tmp}", str(tmp_path)) for text in (where, why))
    flags = [f"--{key}={value}" for key, value in LOCAL.items()]
    with pytest.raises(SystemExit) as info:
        cli.main(["server", *flags, "--checkpoint-dir", path])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and READY_MARKER not in out
    assert err.strip().splitlines() == [
        f"paramserver: error: Cannot make --checkpoint-dir {path}: {why}"
    ]


def test_a_checkpoint_dir_is_checked_before_the_model_is_built_in_process(tmp_path):
    (tmp_path / "a-file").write_text("")
    cfg = ServerConfig(checkpoint_dir=str(tmp_path / "a-file"), model="no.such:model")
    with pytest.raises(ConfigError, match="is not a folder"):
        ServerApp(cfg)  # not "Unknown model": the folder comes first


@pytest.mark.parametrize("route", ["command line", "variable", "config file"])
def test_workers_past_the_int32_of_the_wire_are_one_line_and_exit_2(tmp_path, route):
    """The old server took them, then failed every Join and Status (INTERNAL "Value out of
    range"). --print-config: settings are checked before it prints, as before a start."""
    too_many = str(MAX_INT32 + 1)
    args, env = ["--print-config"], {}
    if route == "command line":
        args.append(f"--workers={too_many}")
    elif route == "variable":
        env["PARAMSERVER_WORKERS"] = too_many
    else:
        config = tmp_path / "paramserver.toml"
        config.write_text(f"[server]\nworkers = {too_many}\n")
        args += ["--config", str(config)]
    line = refused(server_cli(*args, env=env))
    assert f"--workers must be at most {MAX_INT32}; got {too_many}." in line, line
    if route == "config file":
        assert f"[server] workers = {too_many}" in line, line


def test_a_lease_timeout_past_the_clock_is_refused():
    line = refused(server_cli("--lease-timeout", "1e300", "--print-config"))
    assert line.endswith(
        "--lease-timeout must be at most 315360000 seconds (ten years); got 1e+300."
    ), line


def _unchecked(cfg: ServerConfig, **fields: object) -> ServerConfig:
    """``cfg`` with ``fields`` set past its checks: what the reaper must survive anyway."""
    out = dataclasses.replace(cfg)
    for name, value in fields.items():
        object.__setattr__(out, name, value)
    return out


def test_the_lease_reaper_lives_whatever_the_lease():
    """A lease the clock cannot wait (the old reaper died at its first wait: OverflowError)."""
    cfg = _unchecked(ServerConfig(host="127.0.0.1", port=0), lease_seconds=1e300)
    app = ServerApp(cfg).start()
    try:
        app._reaper.join(timeout=0.5)  # returns at once if it died
        assert app._reaper.is_alive() and app.reaper_failures == 0
    finally:
        app.stop(grace=0)


def test_a_failing_reaper_pass_is_logged_counted_and_retried(serve, caplog):
    server = serve("mlp", host="127.0.0.1", lease_seconds=0.2)
    calls: list[float] = []
    real = server.coordinator.expire_leases
    twice = threading.Event()

    def expire(paused: float, at: float | None = None) -> list:
        calls.append(paused)
        if len(calls) == 1:
            raise RuntimeError("a bug in one pass")
        twice.set()
        return real(paused, at)

    server.coordinator.expire_leases = expire  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="paramserver.server.app"):
        assert twice.wait(DEADLINE), "the reaper did not look again after a failure"
    assert server.reaper_failures == 1 and server._reaper.is_alive()
    assert "the lease reaper failed (1 times); it goes on" in caplog.text


@pytest.mark.parametrize(
    ("flag", "why"),
    [(os.ST_RDONLY, "its file system is mounted read-only"), (0, "permission denied")],
)
def test_a_checkpoint_dir_it_may_not_write_in_is_refused_saying_why(
    tmp_path, monkeypatch, flag, why
):
    """Root is kept out of no folder by its permissions (tests run as root), so the folder
    answers as a read-only mount or another user's folder would."""
    from paramserver.server.disk.checkpoint_writer import checkpoint_folder

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_flag=flag))
    with pytest.raises(ConfigError) as info:
        checkpoint_folder(tmp_path / "made")
    assert str(info.value) == f"Cannot write in --checkpoint-dir {tmp_path / 'made'}: {why}."
