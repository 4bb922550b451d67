"""Sync with backup workers (``--backup-workers B``), driven on the coordinator directly: a
round closes once all live workers but B have pushed; a gradient that comes after its round
closed is dropped and counted, and its batches go out again, so each is applied once."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.errors import ConfigError, Timeout
from paramserver.policy import staleness
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.engine.coordinator import Coordinator
from paramserver.server.metrics import Metrics
from tests.conftest import FakeClock

N = 4


def make(workers: int, backups: int, clock: FakeClock) -> Coordinator:
    manifest = Manifest.from_tensors([("w", torch.zeros(N))])
    store = ParameterStore(manifest, np.zeros(N, np.float32), OptimizerConfig("sgd", lr=1.0))
    config = ServerConfig(
        policy="sync",
        workers=workers,
        backup_workers=backups,
        optimizer=OptimizerConfig("sgd", lr=1.0),
        dataset="synthetic",
    )
    return Coordinator(config, store, now=clock)


def full(value: float) -> np.ndarray:
    return np.full(N, value, np.float32)


def test_a_round_of_all_live_workers_but_the_backups_is_complete() -> None:
    live = ["a", "b", "c"]
    done = staleness.round_complete
    assert not done({"a"}, live, backups=1, givers={"a"})
    assert done({"a", "b"}, live, backups=1, givers={"a", "b"})
    assert not done({"a", "b"}, live, givers={"a", "b"})
    # empty pushes (the run's end) close no round early: they wait for everyone
    assert not done({"a", "b"}, live, backups=1, givers={"a"})
    assert done({"a", "b", "c"}, live, backups=1, givers=set())
    assert done({"a"}, ["a"], backups=1)  # one live: itself
    assert not done(set(), live, backups=2)
    assert done({"gone"}, [], backups=1)  # someone, and no one live
    assert staleness.late(2, rounds_done=3) and not staleness.late(3, rounds_done=3)


def test_the_straggler_is_dropped_counted_and_its_batch_goes_out_again() -> None:
    clock = FakeClock(1000.0)
    c = make(3, 1, clock)
    a, b, s = (c.join(n, train_samples=64 * 5) for n in ("a", "b", "straggler"))
    assert [c.pull(w.worker_id, 0, 0).batch for w in (a, b, s)] == [0, 1, 2]
    c.push(a.worker_id, 0, full(1.0), 64, math.nan)
    c.push(b.worker_id, 0, full(3.0), 64, math.nan)
    assert c.store.version == 1  # closed by 2 of 3: the mean of theirs
    np.testing.assert_array_equal(c.store.weights, full(-2.0))
    # the fast ones go on; batch 2 is still the straggler's
    assert [c.pull(w.worker_id, 1, 0).batch for w in (a, b)] == [3, 4]
    late = c.push(s.worker_id, 0, full(100.0), 64, math.nan)
    assert late.clock == 1 and not late.duplicate
    np.testing.assert_array_equal(c.store.weights, full(-2.0))  # not applied, anywhere
    assert c.pull(s.worker_id, 1, 0).batch == 2  # its batch, handed out again (to it)
    c.push(a.worker_id, 1, full(1.0), 64, math.nan)
    c.push(s.worker_id, 1, full(5.0), 64, math.nan)  # in time now: round 1 is a and it
    np.testing.assert_array_equal(c.store.weights, full(-5.0))
    c.push(b.worker_id, 1, full(7.0), 64, math.nan)  # late: b's batch 4 goes back
    status = c.status().as_dict()
    assert status["pushes_late"] == 2 and status["batches_done"] == 4
    assert c.pull(b.worker_id, 2, 0).batch == 4
    c.push(b.worker_id, 2, full(1.0), 64, math.nan)
    c.push(a.worker_id, 2, None, 0, math.nan)  # no batch left for it: an empty push
    status = c.status().as_dict()
    assert status["batches_done"] == 5 == status["batches_total"]  # each batch once
    assert status["batches_applied"] == 5 and status["pushes_repeated"] == 0
    text = _metrics(c)
    assert "paramserver_late_pushes_total 2.0" in text


def _metrics(c: Coordinator) -> str:
    from prometheus_client import generate_latest

    return generate_latest(Metrics(c.status).registry).decode()


def test_the_option_is_for_sync_on_one_shard_below_the_workers() -> None:
    with pytest.raises(ConfigError, match="below --workers"):
        ServerConfig(policy="sync", workers=2, backup_workers=2)
    with pytest.raises(ConfigError, match="for --policy sync"):
        ServerConfig(policy="async", workers=3, backup_workers=1)
    with pytest.raises(ConfigError, match="one server shard"):
        ServerConfig(policy="sync", workers=3, backup_workers=1, shard=0, shards=2)
    assert ServerConfig(policy="sync", workers=3, backup_workers=1).backup_workers == 1


def test_a_late_worker_catches_up_with_the_round_in_progress() -> None:
    """Its pull, once its pushes have all arrived, is answered for the open round (the
    reply says which), so its next gradient can count; a pull with a push of it still on
    the way (overlapped steps) is not moved."""
    clock = FakeClock(1000.0)
    c = make(3, 1, clock)
    a, b, s = (c.join(n, train_samples=64 * 9) for n in ("a", "b", "straggler"))
    for w in (a, b, s):
        c.pull(w.worker_id, 0, 0)
    for t in (0, 1):  # two rounds close without the straggler
        c.push(a.worker_id, t, full(1.0), 64, math.nan)
        c.push(b.worker_id, t, full(1.0), 64, math.nan)
        for w in (a, b):
            c.pull(w.worker_id, t + 1, 0)
    assert c.pull(s.worker_id, 1, 0).iteration == 1  # its push of 0 is still on the way
    c.push(s.worker_id, 0, full(9.0), 64, math.nan)  # late: dropped
    answer = c.pull(s.worker_id, 1, 0)
    assert answer.iteration == 2  # caught up: it computes for round 2, still open
    assert c.membership.get(s.worker_id).clock == 2
    again = c.pull(s.worker_id, 1, 0)  # a retry (its reply lost): the same answer
    assert (again.iteration, again.batches) == (2, answer.batches)
    c.push(s.worker_id, 2, full(4.0), 64, math.nan)
    c.push(a.worker_id, 2, full(2.0), 64, math.nan)  # round 2: the straggler and a
    assert c.rounds == 3 and c.status().as_dict()["pushes_late"] == 1
    # the batches it took for iteration 1 went back when it moved on: none is lost
    for _ in range(20):  # every worker steps at its clock until the run is done
        for w in (b, a, s):
            try:
                got = c.pull(w.worker_id, c.membership.get(w.worker_id).clock, 0)
            except Timeout:  # its round is not closed yet
                continue
            grad = full(1.0) if got.batch >= 0 else None
            c.push(w.worker_id, got.iteration, grad, 64 if grad is not None else 0, math.nan)
    status = c.status().as_dict()
    assert status["batches_done"] == status["batches_total"] == 9, status
    assert status["batches_applied"] == 9


def _schedule_run(by: str) -> list[float]:
    """A sync run of 2 workers over 8 batches (the plan: 4 steps, cosine over them) whose
    second worker leaves after the first round: the rate of each step it takes."""
    clock = FakeClock(1000.0)
    opt = OptimizerConfig("sgd", lr=1.0, schedule="cosine", total_steps=4, by=by)
    manifest = Manifest.from_tensors([("w", torch.zeros(N))])
    store = ParameterStore(manifest, np.zeros(N, np.float32), opt)
    config = ServerConfig(policy="sync", workers=2, optimizer=opt, dataset="synthetic")
    c = Coordinator(config, store, now=clock)
    a, b = (c.join(n, train_samples=64 * 8) for n in ("a", "b"))
    rates = []
    for it in range(7):
        pushers = (a, b) if it == 0 else (a,)
        for w in pushers:
            assert c.pull(w.worker_id, it, 0).batch >= 0
        before = c.store.version
        for w in pushers:
            c.push(w.worker_id, it, full(1.0), 64, math.nan)
        assert c.store.version == before + 1
        rates.append(float(-c.store.weights[0]) - sum(rates))  # SGD: each step moves w by -lr
        if it == 0:
            c.leave(b.worker_id)
    assert c.status().as_dict()["batches_done"] == 8
    return rates


def test_a_schedule_by_batches_decays_over_every_batch_when_steps_are_smaller() -> None:
    """--lr-schedule-by batches (launch's): a run whose rounds lose a worker takes more
    steps than planned; by steps its rate reached 0 with batches left (launch's cosine over
    the planned steps: the rounds past them trained at rate 0); by batches it follows the
    batches done, and the first round's rate is the plan's first."""
    cosine = OptimizerConfig("sgd", lr=1.0, schedule="cosine", total_steps=4)
    by_steps, by_batches = _schedule_run("steps"), _schedule_run("batches")
    assert by_steps[:4] == pytest.approx([cosine.lr_at(i) for i in range(4)])
    assert by_steps[4:] == [0.0, 0.0, 0.0]  # three batches trained at rate 0
    # batches done at each step: 2, 3, ..., 8 of 8; the plan's step reached (2 a step),
    # never past the step itself nor the plan's last: 0, 1, 2, 2, 3, 3, 3
    assert by_batches == pytest.approx([cosine.lr_at(s) for s in (0, 1, 2, 2, 3, 3, 3)])
    assert min(by_batches) > 0


@pytest.mark.parametrize("batches,workers", [(937, 3), (1874, 4), (937, 1), (100, 7)])
def test_a_run_on_its_plan_gets_the_same_rates_by_batches_as_by_steps(batches, workers) -> None:
    """Every step of a run on its plan (rounds of ``workers`` batches, the last one short),
    its batches counted before its rate is read, or (tables under async) one push's not
    yet: the rate by batches is the rate by steps."""
    steps = -(-batches // workers)
    by_steps = OptimizerConfig("sgd", lr=1.0, schedule="cosine", total_steps=steps)
    by_batches = OptimizerConfig("sgd", 1.0, schedule="cosine", total_steps=steps, by="batches")
    for step in range(steps):
        done = min(batches, (step + 1) * workers)
        for counted in (done, done - workers if workers == 1 else done):
            assert by_batches.rate(step, (counted, batches)) == by_steps.lr_at(step), step
