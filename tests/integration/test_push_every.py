"""--push-every K: a worker computes K of the server's batches per push; every batch of the
run is still applied exactly once, in K times fewer optimizer steps."""

from __future__ import annotations

import math

import pytest

from paramserver.config import WorkerConfig
from paramserver.training import data
from paramserver.training.trainer import run
from tests.conftest import WorkerThread


@pytest.mark.parametrize("policy", ["sync", "async"])
def test_push_every_k_applies_every_batch_once_in_fewer_steps(serve, policy):
    epochs, batch, k = 2, 64, 3
    server = serve(
        "mlp",
        policy=policy,
        workers=2,
        optimizer="adam",
        lr=1e-3,
        dataset="synthetic",
        batch_size=batch,
        epochs=epochs,
    )
    total = epochs * data.batches_per_epoch(data.SYNTHETIC_TRAIN, batch)
    threads = []
    for name, every in (("a", k), ("b", 1)):  # chosen per worker
        cfg = WorkerConfig(server=server.address, device="cpu", name=name, push_every=every)
        threads.append(WorkerThread(lambda cfg=cfg: run(cfg), name))
        threads[-1].start()
    summaries = {t.name: t.result() for t in threads}
    status = server.status()
    assert sum(s.samples for s in summaries.values()) == total * batch
    assert status["batches_done"] == status["batches_total"] == total
    assert status["samples"] == total * batch
    # worker a took up to 3 batches a push, b one: fewer pushes than batches
    pushes = summaries["a"].steps + summaries["b"].steps  # steps with a gradient
    assert status["pushes_applied"] == pushes < total
    assert summaries["a"].samples > math.ceil(summaries["a"].steps * batch * 1.5)


def test_a_pull_may_not_ask_for_more_than_the_limit(serve):
    import paramserver as ps

    server = serve("mlp", workers=1)
    with pytest.raises(ps.ConfigError, match="push_every"):
        ps.Worker(server.address, push_every=0)
