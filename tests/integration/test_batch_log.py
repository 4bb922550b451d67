"""``--batch-log``: each worker's log lists the batches whose pushes the server took, so the
workers' logs together list every batch of the run once, also when a worker was paused past
its lease (its push then is dropped and its batches go to another worker: it logged them
anyway, and two logs listed them)."""

from __future__ import annotations

import collections
import os
import signal

from paramserver.cluster.procs import Child, stop_all
from tests.conftest import DEADLINE, wait_until

LEASE, BATCH, EPOCHS, TRAIN = 1.0, 64, 2, 4096


def test_a_worker_paused_past_its_lease_logs_no_batch_another_worker_trained(serve, tmp_path):
    server = serve(
        "mlp",
        host="127.0.0.1",
        dataset="synthetic",
        policy="async",
        workers=2,
        lease_seconds=LEASE,
        batch_size=BATCH,
        epochs=EPOCHS,
        optimizer="sgd",
        lr=0.05,
    )
    logs = [tmp_path / f"batches-{i}.log" for i in range(2)]
    workers = [
        Child(
            f"worker-{i}",
            [
                *("worker", "--server", server.address, "--device", "cpu"),
                *("--step-delay", "0.02", "--batch-log", str(logs[i])),
                *("--server-timeout", "60", "--name", f"w{i}"),
            ],
            tmp_path / f"worker-{i}.log",
        )
        for i in range(2)
    ]
    try:
        wait_until(lambda: server.status()["batches_done"] >= 10, "10 batches done")
        os.kill(workers[0].proc.pid, signal.SIGSTOP)  # paused in the middle of its step
        wait_until(lambda: server.status()["workers_expired"] >= 1, "its lease lapsed")
        done = server.status()["batches_done"]
        wait_until(lambda: server.status()["batches_done"] >= done + 5, "the other worker on")
        os.kill(workers[0].proc.pid, signal.SIGCONT)
        for w in workers:
            assert w.proc.wait(DEADLINE) == 0, w.tail()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                os.kill(w.proc.pid, signal.SIGCONT)
        stop_all(workers)
    total = EPOCHS * (TRAIN // BATCH)
    assert server.status()["batches_done"] == total
    listed = collections.Counter(
        int(b) for path in logs for line in path.read_text().splitlines() for b in line.split()
    )
    twice = sorted(b for b, n in listed.items() if n > 1)
    assert twice == [], f"batches in two logs: {twice}"
    assert set(listed) == set(range(total))
