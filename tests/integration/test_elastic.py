"""Elastic membership under sync: training starts at --min-workers, a worker joins mid-run,
another leaves cleanly, and every batch of the run is applied exactly once."""

from __future__ import annotations

from paramserver.config import WorkerConfig
from paramserver.training import data
from paramserver.training.trainer import run
from tests.conftest import DEADLINE, WorkerThread


def test_workers_join_and_leave_a_sync_run_and_no_batch_is_lost_or_repeated(serve):
    epochs, batch = 2, 32
    server = serve(
        "mlp",
        policy="sync",
        workers=3,
        min_workers=2,
        optimizer="sgd",
        lr=0.05,
        dataset="synthetic",
        batch_size=batch,
        epochs=epochs,
        lease_seconds=5.0,
    )
    total = epochs * data.batches_per_epoch(data.SYNTHETIC_TRAIN, batch)

    def worker(name: str, **kw) -> WorkerThread:
        cfg = WorkerConfig(server=server.address, device="cpu", name=name, step_delay=0.005, **kw)
        thread = WorkerThread(lambda: run(cfg), name)
        thread.start()
        return thread

    leaver = worker("leaver", max_steps=20)
    stayer = worker("stayer")
    assert server.wait_for_version(5, DEADLINE), "training did not start with 2 of 3 workers"
    assert server.status()["workers_joined"] == 2
    late = worker("late")

    summaries = {t.name: t.result() for t in (leaver, stayer, late)}
    status = server.status()
    assert summaries["leaver"].steps == 20
    assert summaries["late"].steps > 0, "the late worker joined after the run ended"
    assert sum(s.samples for s in summaries.values()) == total * batch
    assert status["batches_done"] == status["batches_total"] == total
    assert status["pushes_applied"] == total
    assert (status["workers_joined"], status["workers_expired"]) == (3, 0)
    assert status["workers"] == []
