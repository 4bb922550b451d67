"""Links that fail, on the namespace network (cluster/netns.py): a server and two workers,
each on its own host, training the MLP on the synthetic set under sync over the data port.
A worker's link down for longer than its lease: the run goes on without it, it rejoins
when the link comes back, and every batch is trained exactly once. The server's link down
for 5 s, past the workers' call deadline and within their lease: they go on once it is
back (calls that failed are retried), nobody is dropped and nothing is lost."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from paramserver.cluster import netns
from paramserver.cluster.commands import CHILD_ENV
from paramserver.cluster.procs import READY_MARKER

# Network namespaces on one fixed subnet, counted machine-wide: one such test at a time
# under `make test`'s processes (tests/conftest.py).
pytestmark = [
    pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable())),
    pytest.mark.xdist_group("netns"),
]

DEADLINE = 120.0
PORT = 50051
PS = [sys.executable, "-m", "paramserver"]
EPOCHS = 3
BATCHES = EPOCHS * 4096 // 64  # the synthetic set's 4096 samples, batches of 64


class Cluster:
    """A server on ``server``, a watcher of its status beside it, workers on w0 and w1."""

    def __init__(self, net: netns.Network, tmp: Path, lease: float):
        self.net, self.tmp = net, tmp
        self.env = {**os.environ, **CHILD_ENV}
        server = [*PS, "server", "--host", "0.0.0.0", "--port", str(PORT), "--model", "mlp"]
        server += ["--dataset", "synthetic", "--epochs", str(EPOCHS), "--batch-size", "64"]
        server += ["--policy", "sync", "--workers", "2", "--min-workers", "1"]
        server += ["--lease-timeout", str(lease)]
        self.server = net.run("server", server, self.env, tmp / "server.log")
        self.wait(lambda: READY_MARKER in self.log("server"), "the server to serve")
        watch = [*PS, "status", "--server", f"127.0.0.1:{PORT}", "--json", "--watch", "0.1"]
        net.run("server", watch, self.env, tmp / "status.log")
        self.workers = {}
        for host in ("w0", "w1"):
            worker = [*PS, "worker", "--server", f"{net.addr['server']}:{PORT}", "--name", host]
            worker += ["--shm", "off", "--rpc-timeout", "3", "--step-delay", "0.03"]
            worker += ["--server-timeout", "120"]
            self.workers[host] = net.run(host, worker, self.env, tmp / f"{host}.log")

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def status(self) -> dict[str, Any]:
        """The newest whole status line the watcher wrote ({} before the first)."""
        for line in reversed(self.log("status").splitlines()):
            try:
                return json.loads(line)  # type: ignore[no-any-return]
            except json.JSONDecodeError:
                continue  # the line being written
        return {}

    def live(self) -> set[str]:
        return {w["name"] for w in self.status().get("workers", [])}

    def wait(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + DEADLINE
        while not done():
            if self.server.poll() is not None:
                raise AssertionError(f"the server exited: {self.log('server')[-2000:]}")
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.status()}"
            time.sleep(0.05)  # the watcher's next line; bounded by the deadline

    def finish(self) -> dict[str, Any]:
        """Both workers' exit (each 0), then the server's last status."""
        for host, proc in self.workers.items():
            code = proc.wait(DEADLINE)
            assert code == 0, f"{host} exited {code}: {self.log(host)[-2000:]}"
        self.wait(lambda: self.status().get("batches_done") == BATCHES, "the last batch")
        return self.status()


def _exactly_once(status: dict[str, Any]) -> None:
    assert status["batches_total"] == BATCHES
    assert status["batches_done"] == int(status["batches_applied"]) == BATCHES, status
    assert status["samples"] == BATCHES * 64, status


def test_a_worker_cut_off_past_its_lease_is_dropped_and_rejoins(tmp_path):
    with netns.Network(["server", "w0", "w1"]) as net:
        run = Cluster(net, tmp_path, lease=2.0)
        run.wait(lambda: run.live() == {"w0", "w1"} and run.status()["version"] >= 5, "a start")
        net.cut("w1")
        run.wait(lambda: run.live() == {"w0"}, "the server to drop w1")
        dropped_at = run.status()["version"]
        run.wait(lambda: run.status()["version"] >= dropped_at + 5, "sync to go on without w1")
        assert "w1" not in run.live()
        net.restore("w1")
        run.wait(lambda: "w1" in run.live(), "w1 to rejoin")
        status = run.finish()
        _exactly_once(status)
        assert all("over the data port" in run.log(w) for w in ("w0", "w1"))  # the path cut
        assert status["workers_expired"] >= 1
        assert "rejoined" in run.log("w1")


def test_a_server_cut_off_for_a_few_seconds_loses_nothing(tmp_path):
    with netns.Network(["server", "w0", "w1"]) as net:
        run = Cluster(net, tmp_path, lease=20.0)
        run.wait(lambda: run.live() == {"w0", "w1"} and run.status()["version"] >= 5, "a start")
        net.cut("server")
        stalled = run.status()["version"]

        def unheard_for(seconds: float) -> bool:
            workers = run.status().get("workers", [])
            return len(workers) == 2 and all(w["last_seen_seconds"] >= seconds for w in workers)

        # the watcher is on the server's host: it still sees the server. Past the workers'
        # call deadline (3 s), within their lease (20 s)
        run.wait(lambda: unheard_for(5.0), "5 s without a word from either worker")
        # at most one step in flight a worker: a push whose bytes were in the server's
        # socket buffers when the link went down is still applied (CI saw 6 -> 8)
        assert run.status()["version"] <= stalled + 2
        net.restore("server")
        status = run.finish()
        _exactly_once(status)
        assert all("over the data port" in run.log(w) for w in ("w0", "w1"))  # the path cut
        assert status["workers_expired"] == 0  # nobody was dropped: they resumed
