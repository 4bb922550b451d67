"""``Members.done`` (``server --exit-when-done``). On a shard other than 0, which hands out
no batches, the run is over once a live worker of this incarnation left saying so
(``LeaveRequest.finished``) and no worker is live; a worker that leaves without saying so
(killed, or stopped early) ends nothing. Shard 0 hands out the batches, decides for itself
and believes no Leave (issue 55, defect 1: a Leave from a member with batches left, from an
id that never joined, or from before a restart with more --epochs made the server exit 0
with the run unfinished)."""

from __future__ import annotations

import math

import numpy as np
import torch

from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.engine.coordinator import Coordinator
from tests.conftest import FakeClock
from tests.unit.test_coordinator import LEASE, N, full, make


def shard_1(policy: str, workers: int, clock: FakeClock) -> Coordinator:
    """Shard 1 of 2, which hands out no batches (``make``'s coordinator is shard 0)."""
    manifest = Manifest.from_tensors([("w", torch.zeros(N))])
    sgd = OptimizerConfig("sgd", lr=1.0)
    store = ParameterStore(manifest, np.zeros(N, np.float32), sgd)
    config = ServerConfig(
        policy=policy, workers=workers, lease_seconds=LEASE, optimizer=sgd, shard=1, shards=2
    )
    return Coordinator(config, store, now=clock, model_numel=2 * N, shard_offset=N)


def test_a_run_ends_when_a_worker_said_so_and_none_is_left():
    c = shard_1("async", 2, FakeClock(1000.0))
    assert not c.members.done  # nobody joined: not started
    a, b = c.join("a"), c.join("b")
    c.leave(a.worker_id, finished=True, incarnation=c.incarnation)
    assert not c.members.done  # b is still live
    c.leave(b.worker_id)
    assert c.members.done


def test_workers_that_leave_without_saying_so_end_nothing():
    c = shard_1("sync", 2, FakeClock(1000.0))
    a, b = c.join("a"), c.join("b")
    c.leave(a.worker_id)
    c.leave(b.worker_id)
    assert not c.members.done  # every worker gone, the run not over: they may come back


def test_a_lease_that_runs_out_after_the_end_is_as_good_as_a_leave():
    clock = FakeClock(1000.0)
    c = shard_1("async", 2, clock)
    a, _ = c.join("a"), c.join("b")
    c.leave(a.worker_id, finished=True, incarnation=c.incarnation)
    clock.advance(2 * LEASE)
    c.expire_leases()
    assert c.members.done


def test_a_leave_from_an_unknown_id_or_another_incarnation_ends_nothing():
    c = shard_1("async", 2, FakeClock(1000.0))
    a, b = c.join("a"), c.join("b")
    c.leave("never-joined", finished=True, incarnation=c.incarnation)
    c.leave(a.worker_id, finished=True, incarnation="an-earlier-one")  # before a restart
    c.leave(b.worker_id, finished=True)  # names no incarnation: proves nothing
    assert not c.membership.members and not c.members.done


def test_the_shard_handing_out_batches_believes_no_leave_until_they_are_all_applied():
    c = make("async", 2, FakeClock(1000.0))
    a = c.join("a", train_samples=64 * 3)  # 3 batches
    b = c.join("b", train_samples=64 * 3)
    assert c.pull(a.worker_id, 0, 0).batches == (0,)
    c.push(a.worker_id, 0, full(1.0), 64, math.nan)
    c.leave(a.worker_id, finished=True, incarnation=c.incarnation)  # 2 batches are left
    c.leave(b.worker_id, finished=True, incarnation=c.incarnation)
    assert not c.members.done and c.queue.done == 1
    w = c.join("w", train_samples=64 * 3)  # the run goes on: 1 and 2 are handed out again
    for t in range(2):
        assert c.pull(w.worker_id, t, 0).batches
        c.push(w.worker_id, t, full(1.0), 64, math.nan)
    assert not c.members.done  # w is still live
    c.leave(w.worker_id)  # not even saying so: this shard knows the run is over
    assert c.members.done


def test_shard_0_without_a_batch_plan_believes_no_leave():
    """A run of the workers' own data: two joins and two Leaves saying the run is over,
    with the incarnation a Join answers, end nothing on shard 0 (it never ends by itself)."""
    c = make("async", 2, FakeClock(1000.0))
    a, b = c.join("a"), c.join("b")
    for w in (a, b):
        c.leave(w.worker_id, finished=True, incarnation=c.incarnation)
    assert c.members.started and not c.members.done


def test_another_shard_plans_no_batches_and_a_new_member_means_the_run_goes_on():
    c = shard_1("async", 2, FakeClock(1000.0))
    a = c.join("a", train_samples=64 * 3)  # a Join that names data: shard 1 hands out none
    assert c.queue is None
    b = c.join("b")
    c.leave(a.worker_id, finished=True, incarnation=c.incarnation)
    d = c.join("d")  # joined after: the run goes on (extended, say), until told again
    c.leave(b.worker_id)
    c.leave(d.worker_id)
    assert not c.members.done
    e = c.join("e")
    c.leave(e.worker_id, finished=True, incarnation=c.incarnation)
    assert c.members.done
