"""A newcomer's first hour (issue 30, musts 4 and 7): no wait is silent, a finished run says
so wherever it is met, and the small things a user notices read right."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading

import pytest

import paramserver as ps
from paramserver.cluster.procs import READY_MARKER, Child, stop_all
from paramserver.errors import ServerUnavailable
from paramserver.transport import stub
from paramserver.worker import waits
from tests.conftest import (
    DEADLINE,
    WorkerThread,
    cli,
    free_port,
    paramserver_popen,
    paramserver_run,
    tiny_model,
)


def test_a_worker_at_a_wrong_port_says_whom_it_waits_for_and_until_when():
    port = free_port()
    out = cli("worker", "--server", f"127.0.0.1:{port}", "--server-timeout", "2.5")
    assert out.returncode == 1, out.stderr
    said = [line for line in out.stderr.splitlines() if "waiting for a parameter server" in line]
    assert said and f"at 127.0.0.1:{port}" in said[0], out.stderr
    assert re.search(r"until \d\d:\d\d:\d\d", said[0]), said[0]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("paramserver: error: No parameter") and "--server-timeout 2.5" in last


def test_the_wait_for_a_server_is_said_again_every_period(caplog):
    caplog.set_level(logging.INFO, logger="paramserver.transport.stub")
    with pytest.raises(ServerUnavailable):
        stub.connect(f"127.0.0.1:{free_port()}", 2.0, every=0.4)
    said = [r for r in caplog.records if "waiting for a parameter server" in r.getMessage()]
    assert 3 <= len(said) <= 5, [r.getMessage() for r in said]


def test_a_worker_waiting_for_min_workers_says_how_many_are_live(serve, monkeypatch):
    monkeypatch.setattr(waits, "EVERY", 0.3)
    server = serve(tiny_model(), workers=2, min_workers=2, lease_seconds=0.9)
    said: list[str] = []
    seen = threading.Event()

    class Heard(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())
            if "1 of 2 workers are live" in said[-1]:
                seen.set()

    heard, logger = Heard(level=logging.INFO), logging.getLogger("paramserver.worker.session")
    logger.addHandler(heard)
    level = logger.level
    logger.setLevel(logging.INFO)
    # a Worker pulls the run's first weights as it starts: the first waits for the second
    first = WorkerThread(lambda: ps.Worker(server.address, tiny_model(), train_samples=256))
    first.start()
    try:
        assert seen.wait(DEADLINE), said
        message = next(m for m in said if "1 of 2" in m)
        assert message.startswith(f"The pull of iteration 0 from {server.address} has waited")
        assert "the run has not started" in message and "--min-workers" in message
        with ps.Worker(server.address, tiny_model(), train_samples=256):
            first.result().close()
    finally:
        logger.removeHandler(heard)
        logger.setLevel(level)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A launch of 2 epochs on the synthetic set, checkpointing into a folder: its stderr,
    its summary and the folder."""
    root = tmp_path_factory.mktemp("finished")
    out = cli(
        "launch",
        "--workers",
        "2",
        "--dataset",
        "synthetic",
        "--epochs",
        "2",
        "--policy",
        "delay-1",
        "--runs-dir",
        str(root / "runs"),
        "--checkpoint-dir",
        str(root / "ckpt"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out, root


def test_launch_says_every_epoch_alike_and_names_delay_1_as_given(finished_run):
    out, root = finished_run
    epochs = [line for line in out.stderr.splitlines() if "epoch " in line and "test acc" in line]
    assert [line.split(":")[0] for line in epochs] == ["epoch 1", "epoch 2"], out.stderr
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith("delay-1 (ssp:1), 2 workers, 2 epochs:"), summary
    (run,) = (root / "runs").iterdir()
    assert run.name.endswith("-delay-1"), run.name
    assert json.loads((run / "summary.json").read_text())["policy"] == "ssp:1"


def test_a_fresh_run_logs_each_worker_as_joined_once(finished_run):
    _, root = finished_run
    (run,) = (root / "runs").iterdir()
    log = "\n".join(p.read_text() for p in run.glob("**/*.log") if "server" in p.name)
    assert log.count(" joined as rank ") == 2, log[-3000:]
    assert "rejoined" not in log


def test_a_finished_run_says_so_at_the_server_the_worker_and_status(finished_run, tmp_path):
    _, root = finished_run
    procs: list[Child] = []
    try:
        server = Child(
            "server",
            ["server", "--dataset", "synthetic", "--epochs", "2", "--workers", "2"]
            + ["--port", "0", "--host", "127.0.0.1", "--checkpoint-dir", str(root / "ckpt")],
            tmp_path / "server.log",
            capture_stdout=True,
        )
        procs.append(server)
        address = server.wait_for_line(READY_MARKER, DEADLINE).rsplit(" ", 1)[-1]
        said = (tmp_path / "server.log").read_text()
        assert "is over: all" in said and "--checkpoint-dir" in said, said[-2000:]
        worker = cli("worker", "--server", address, "--device", "cpu")
        assert worker.returncode == 0, worker.stderr[-2000:]
        assert "was over before this worker computed a batch" in worker.stderr
        table = cli("status", "--server", address)
        assert "RUN FINISHED" in table.stdout, table.stdout
        line = json.loads(cli("status", "--server", address, "--json").stdout)
        assert line["finished"] is True and line["batches_done"] == line["batches_total"] > 0
    finally:
        stop_all(procs)


@pytest.mark.parametrize("epochs", [3, 1])
def test_a_finished_run_goes_on_with_more_epochs_and_says_why_fewer_do_nothing(
    finished_run, tmp_path, epochs
):
    _, root = finished_run
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt", ckpt)  # the fixture's run stays as it was
    procs: list[Child] = []
    try:
        server = Child(
            "server",
            ["server", "--dataset", "synthetic", "--epochs", str(epochs), "--workers", "1"]
            + ["--port", "0", "--host", "127.0.0.1", "--checkpoint-dir", str(ckpt)],
            tmp_path / "server.log",
            capture_stdout=True,
        )
        procs.append(server)
        address = server.wait_for_line(READY_MARKER, DEADLINE).rsplit(" ", 1)[-1]
        said = (tmp_path / "server.log").read_text()
        before = json.loads(cli("status", "--server", address, "--json").stdout)
        worker = cli("worker", "--server", address, "--device", "cpu")
        assert worker.returncode == 0, worker.stderr[-2000:]
        after = json.loads(cli("status", "--server", address, "--json").stdout)
        per_epoch = before["batches_done"] // 2
        if epochs == 3:
            assert "the run goes on from 2 to 3 epochs" in said, said[-2000:]
            assert before["batches_total"] == 3 * per_epoch and not before["finished"]
            assert after["batches_done"] == after["batches_total"] == 3 * per_epoch
            assert after["finished"] is True
        else:
            assert "--epochs 1 is ignored: the run resumed holds 2 epochs" in said, said[-2000:]
            assert after["batches_done"] == after["batches_total"] == 2 * per_epoch
    finally:
        stop_all(procs)


def test_ctrl_c_ends_status_watch_quietly(serve):
    server = serve("mlp", host="127.0.0.1")
    # Ctrl-C as a terminal delivers it: a shell's background job (CI's) ignores SIGINT, and
    # so would its children; the suite does not (tests/conftest.py). Not a preexec_fn: a
    # fork in this process, whose gRPC restarts its poller in the child, which then died
    # of epoll_wait's EBADF before its exec (exit -6; grpc/grpc#43055)
    proc = paramserver_popen(
        "status", "--server", server.address, "--watch", "0.2",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # a redraw has happened
        if not first:  # it ended: say why (it failed once so under -n 2 on a loaded host)
            assert proc.stderr is not None
            why = f"exit {proc.wait(timeout=DEADLINE)}: {proc.stderr.read()[-2000:]}"
            raise AssertionError(f"status --watch printed nothing ({why})")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=DEADLINE)
        assert proc.returncode == 0, err
        assert "aborted" not in err and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=DEADLINE)


def test_a_port_in_use_is_one_sentence_of_ours(serve):
    server = serve("mlp", host="127.0.0.1")
    out = cli("server", "--host", "127.0.0.1", "--port", str(server.port))
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last == (
        f"paramserver: error: Cannot listen on 127.0.0.1:{server.port}: the port is in use "
        "(another server?). Pick another --port, or stop what holds it."
    )
    assert "GRPC_VERBOSITY" not in out.stderr and "add_port" not in out.stderr


def test_an_address_not_on_this_machine_is_named_as_such():
    out = cli("server", "--host", "192.0.2.1", "--port", str(free_port()))  # TEST-NET-1
    assert out.returncode == 2
    assert (
        out.stderr.strip().splitlines()[-1].endswith("this machine has no such address (--host).")
    )


def test_status_and_health_take_the_workers_list_of_shards_and_ask_the_first(serve):
    """PARAMSERVER_SERVER is one setting: a worker's comma-separated shards; status and
    health ask the first (shard 0)."""
    server = serve("mlp", host="127.0.0.1")
    shards = f"{server.address},127.0.0.1:{free_port()}"
    env = {**os.environ, "PARAMSERVER_SERVER": shards}
    for command in (["status", "--json"], ["health"]):
        out = paramserver_run(*command, env=env)
        assert out.returncode == 0, out.stderr
    line = json.loads(cli("status", "--server", shards, "--json").stdout)
    assert line["incarnation"] == server.status()["incarnation"]
