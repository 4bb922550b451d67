"""kill -9 one of 4 workers under sync: the stall is bounded by the lease, the run completes,
and every batch of the run is applied exactly once (the dead worker's goes to the others).
And a live worker that is slow to start keeps its lease."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import paramserver as ps
from paramserver.training import data
from tests.conftest import DEADLINE, ones_step, paramserver_popen, tiny_model, wait_until

LEASE = 1.0


def test_sync_run_survives_a_killed_worker(serve, children, tmp_path):
    epochs, batch, workers = 2, 32, 4
    server = serve(
        "mlp",
        policy="sync",
        workers=workers,
        optimizer="sgd",
        lr=0.05,
        dataset="synthetic",
        batch_size=batch,
        epochs=epochs,
        lease_seconds=LEASE,
    )
    total = epochs * data.batches_per_epoch(data.SYNTHETIC_TRAIN, batch)
    logs = []
    for i in range(workers):
        log = open(tmp_path / f"worker-{i}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        children.append(
            paramserver_popen(
                "worker",
                "--server",
                server.address,
                "--device",
                "cpu",
                "--name",
                f"w{i}",
                "--rpc-timeout",
                "60",
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )

    # Let the run get going, then kill one worker without warning.
    assert server.wait_for_version(5, DEADLINE), "the run never reached version 5"
    victim = children[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(DEADLINE)
    killed = time.monotonic()
    killed_at = server.status()["version"]

    # The longest gap between two optimizer steps after the kill: the stall.
    stall, last, version = 0.0, killed, killed_at
    while server.status()["batches_done"] < total:
        assert server.wait_for_version(version + 1, DEADLINE), f"stuck at version {version}"
        now = time.monotonic()
        stall, last, version = max(stall, now - last), now, server.status()["version"]
    print(f"stall after kill -9 of 1 of 4 sync workers: {stall:.2f}s (lease {LEASE}s)")

    for i in (0, 2, 3):
        assert children[i].wait(DEADLINE) == 0, (tmp_path / f"worker-{i}.log").read_text()[-2000:]
    for log in logs:
        log.close()
    status = server.status()
    assert status["workers_expired"] == 1
    assert killed_at < status["version"]
    # Nothing lost, nothing twice: one applied gradient per batch of the run.
    assert status["batches_done"] == total
    assert status["pushes_applied"] == total
    assert status["workers"] == []  # survivors left cleanly
    # The lease bounds the stall: the dead worker is dropped once it runs out (the reaper
    # checks every lease/4); the margin absorbs a loaded machine, not a missing bound.
    assert stall < LEASE + 5.0


def test_a_worker_keeps_its_lease_while_it_loads_its_data_after_joining(serve):
    """A worker joins (to learn the plan), then builds its model and loads its data: its
    heartbeats run from the join on. They started after the load, so with a lease shorter
    than the load every worker was dropped at the start of a run (``paramserver chaos`` at
    a 2 s lease), and the first one back trained rounds alone."""
    lease = 0.5
    server = serve(tiny_model(), policy="sync", workers=1, lease_seconds=lease)
    loading = threading.Event()

    def slow_load(plan) -> int:
        loading.wait(4 * lease)  # a data set that takes four leases to load
        return 0

    model = tiny_model()
    with ps.Worker(server.address, model, train_samples=slow_load) as worker:
        ones_step(worker, model)
        assert worker.rejoins == 0
    status = server.status()
    assert status["workers_expired"] == 0 and status["version"] == 1, status


def test_a_worker_that_fails_to_start_after_joining_leaves_no_ghost(serve, monkeypatch):
    """Its heartbeats run from the join on, so a failure between the join and the first
    pull must end them and leave the run, or the server would keep a member that never
    pushes (under sync, a round waiting for it for good)."""
    from paramserver.worker import worker as worker_module

    def broken(*args, **kwargs):
        raise RuntimeError("no loader")

    server = serve(tiny_model(), policy="sync", workers=2)
    monkeypatch.setattr(worker_module.stages, "loader", broken)
    try:
        ps.Worker(server.address, tiny_model())
    except RuntimeError as exc:
        assert "no loader" in str(exc)
    else:
        raise AssertionError("the worker started")
    status = server.status()
    assert status["workers"] == [] and status["workers_joined"] == 1, status
    beating = lambda: [t for t in threading.enumerate() if t.name.startswith("ps-heartbeat")]  # noqa: E731
    wait_until(lambda: not beating(), "the heartbeats ended")
