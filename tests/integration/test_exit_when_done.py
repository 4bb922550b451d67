"""``server --exit-when-done``: two shards exit 0 on their own once the run is over and both
workers have left (shard 1, which hands out no batches, learns the end from their Leave),
each with a last checkpoint; without the flag a server keeps running (SIGTERM ends it)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from paramserver.cluster.procs import READY_MARKER, Child, stop_all
from tests.conftest import DEADLINE


def _servers(tmp_path: Path, flag: list[str]) -> tuple[list[Child], list[str]]:
    procs, addresses = [], []
    for i in range(2):
        server = Child(
            f"server-{i}",
            ["server", "--shard", f"{i}/2", "--port", "0", *flag],
            tmp_path / f"server-{i}.log",
            capture_stdout=True,
            env={
                "PARAMSERVER_DATASET": "synthetic",
                "PARAMSERVER_EPOCHS": "1",
                "PARAMSERVER_WORKERS": "2",
                "PARAMSERVER_RUN_DIR": "off",
                "PARAMSERVER_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
                "PARAMSERVER_CHECKPOINT_EVERY": "50",
            },
        )
        procs.append(server)
        addresses.append(server.wait_for_line(READY_MARKER, DEADLINE).rsplit(" ", 1)[-1])
    return procs, addresses


def _workers(tmp_path: Path, addresses: list[str]) -> list[Child]:
    return [
        Child(
            f"worker-{i}",
            ["worker", "--server", ",".join(addresses), "--device", "cpu"],
            tmp_path / f"worker-{i}.log",
        )
        for i in range(2)
    ]


def test_shards_exit_once_the_run_is_over_and_the_workers_left(tmp_path):
    procs: list[Child] = []
    try:
        servers, addresses = _servers(tmp_path, ["--exit-when-done"])
        procs += servers
        workers = _workers(tmp_path, addresses)
        procs += workers
        for w in workers:
            assert w.proc.wait(DEADLINE) == 0, w.tail(20)
        for i, s in enumerate(servers):
            assert s.proc.wait(DEADLINE) == 0, s.tail(20)
            log = (tmp_path / f"server-{i}.log").read_text()
            assert "every worker has left: stopping (--exit-when-done)" in log
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()), "no checkpoint written"
    finally:
        stop_all(procs)


def test_without_the_flag_a_server_outlives_the_run(tmp_path):
    procs: list[Child] = []
    try:
        servers, addresses = _servers(tmp_path, [])
        procs += servers
        workers = _workers(tmp_path, addresses)
        procs += workers
        for w in workers:
            assert w.proc.wait(DEADLINE) == 0, w.tail(20)
        for s in servers:  # with the flag, each would be gone within a second or two
            with pytest.raises(subprocess.TimeoutExpired):
                s.proc.wait(timeout=3)
    finally:
        stop_all(procs)
