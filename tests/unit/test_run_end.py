"""``Members.done`` (``server --exit-when-done``) on a shard that hands out no batches: the
run is over once a worker left saying so (``LeaveRequest.finished``) and no worker is live;
a worker that leaves without saying so (killed, or stopped early) ends nothing."""

from __future__ import annotations

from tests.conftest import FakeClock
from tests.unit.test_coordinator import LEASE, make


def test_a_run_ends_when_a_worker_said_so_and_none_is_left():
    c = make("async", 2, FakeClock(1000.0))
    assert not c.members.done  # nobody joined: not started
    a, b = c.join("a"), c.join("b")
    c.leave(a.worker_id, finished=True)
    assert not c.members.done  # b is still live
    c.leave(b.worker_id)
    assert c.members.done


def test_workers_that_leave_without_saying_so_end_nothing():
    c = make("sync", 2, FakeClock(1000.0))
    a, b = c.join("a"), c.join("b")
    c.leave(a.worker_id)
    c.leave(b.worker_id)
    assert not c.members.done  # every worker gone, the run not over: they may come back


def test_a_lease_that_runs_out_after_the_end_is_as_good_as_a_leave():
    clock = FakeClock(1000.0)
    c = make("async", 2, clock)
    a, _ = c.join("a"), c.join("b")
    c.leave(a.worker_id, finished=True)
    clock.advance(2 * LEASE)
    c.expire_leases()
    assert c.members.done
