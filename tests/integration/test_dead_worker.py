"""kill -9 one of 3 workers under sync: the others go on once its lease expires; the run completes."""

from __future__ import annotations

import os
import signal
import subprocess

from paramserver import data
from tests.conftest import DEADLINE, paramserver_cmd


def test_sync_run_survives_a_killed_worker(serve, children, tmp_path):
    epochs, batch, workers = 2, 32, 3
    server = serve(
        "mlp",
        policy="sync",
        workers=workers,
        optimizer="sgd",
        lr=0.05,
        dataset="synthetic",
        batch_size=batch,
        epochs=epochs,
        lease_seconds=0.5,
    )
    steps = epochs * data.steps_per_epoch(4096, workers, batch)
    logs = []
    for i in range(workers):
        log = open(tmp_path / f"worker-{i}.log", "wb")  # noqa: SIM115 - closed below
        logs.append(log)
        children.append(subprocess.Popen(
            paramserver_cmd("worker", "--server", server.address, "--device", "cpu",
                            "--name", f"w{i}", "--rpc-timeout", "60"),
            stdout=log, stderr=subprocess.STDOUT,
        ))  # fmt: skip

    # Let the run get going, then kill one worker without warning.
    assert server.wait_for_version(5, DEADLINE), "the run never reached version 5"
    victim = children[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(DEADLINE)
    killed_at = server.status()["version"]

    # The survivors finish every planned round (each round averages the live workers).
    for p in (children[0], children[2]):
        assert p.wait(DEADLINE) == 0, (tmp_path / "worker-0.log").read_text()[-2000:]
    for log in logs:
        log.close()
    status = server.status()
    assert status["workers_expired"] == 1
    assert status["version"] == steps
    assert killed_at < steps
    assert status["workers"] == []  # survivors left cleanly
