"""Membership bookkeeping with a fake clock."""

from __future__ import annotations

import pytest

from paramserver.errors import ClusterFull, UnknownWorker
from paramserver.server.bookkeeping.leases import Membership
from tests.conftest import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(100.0)


def make(clock: FakeClock, capacity: int = 3, lease: float = 10.0) -> Membership:
    return Membership(capacity=capacity, lease_seconds=lease, now=clock)


def test_ranks_are_lowest_free_slot(clock: FakeClock) -> None:
    m = make(clock)
    a, b, c = m.join("a"), m.join("b"), m.join("c")
    assert [a.rank, b.rank, c.rank] == [0, 1, 2]
    assert len({a.worker_id, b.worker_id, c.worker_id}) == 3
    assert m.joined_total == 3
    assert m.live_ids() == [a.worker_id, b.worker_id, c.worker_id]


def test_rank_freed_by_leave_is_reused(clock: FakeClock) -> None:
    m = make(clock)
    a, b, _ = m.join("a"), m.join("b"), m.join("c")
    assert m.leave(b.worker_id) is b
    assert m.leave(b.worker_id) is None  # not live any more
    d = m.join("d")
    assert d.rank == 1
    m.leave(a.worker_id)
    assert m.join("e").rank == 0
    assert m.joined_total == 5


def test_rank_freed_by_expiry_is_reused(clock: FakeClock) -> None:
    m = make(clock, capacity=2)
    a = m.join("a")
    clock.advance(5)
    b = m.join("b")
    clock.advance(6)  # a is 11s old, b 6s
    assert m.expire() == [a]
    assert m.live_ids() == [b.worker_id]
    assert m.join("c").rank == a.rank == 0


def test_cluster_full_names_capacity(clock: FakeClock) -> None:
    m = make(clock, capacity=2)
    m.join("a")
    m.join("b")
    with pytest.raises(ClusterFull) as info:
        m.join("late")
    assert "2 workers" in str(info.value)
    assert "'late'" in str(info.value)
    assert len(m.members) == 2
    assert m.joined_total == 2


def test_newcomer_takes_slowest_live_clock(clock: FakeClock) -> None:
    m = make(clock)
    a, b = m.join("a"), m.join("b")
    for _ in range(5):
        m.advance(a.worker_id, 1)
    for _ in range(3):
        m.advance(b.worker_id, 1)
    c = m.join("c", start_clock=42)  # start_clock ignored: someone is live
    assert c.clock == 3
    assert m.min_clock() == 3


def test_start_clock_used_when_nobody_live(clock: FakeClock) -> None:
    m = make(clock)
    assert m.min_clock() is None
    assert m.join("a", start_clock=7).clock == 7
    assert m.join("b").clock == 7


def test_floor_remembered_after_everyone_leaves(clock: FakeClock) -> None:
    m = make(clock)
    a, b = m.join("a"), m.join("b")
    for _ in range(4):
        m.advance(a.worker_id, 1)
    for _ in range(6):
        m.advance(b.worker_id, 1)
    m.leave(a.worker_id)
    m.leave(b.worker_id)  # b was the only (so the slowest) live worker: clock 6
    assert m.min_clock() is None
    assert m.join("c").clock == 6


def test_floor_is_slowest_of_those_expiring_together(clock: FakeClock) -> None:
    m = make(clock)
    a, b = m.join("a"), m.join("b")
    for _ in range(4):
        m.advance(a.worker_id, 1)
    for _ in range(6):
        m.advance(b.worker_id, 1)
    clock.advance(11)
    assert sorted(w.name for w in m.expire()) == ["a", "b"]
    assert m.min_clock() is None
    assert m.join("c").clock == 4


def test_floor_remembered_after_everyone_expires(clock: FakeClock) -> None:
    m = make(clock)
    a = m.join("a")
    for _ in range(5):
        m.advance(a.worker_id, 1)
    clock.advance(11)
    assert m.expire() == [a]
    assert m.join("b").clock == 5


def test_start_clock_wins_over_floor_when_nobody_live(clock: FakeClock) -> None:
    m = make(clock)
    a = m.join("a")
    m.advance(a.worker_id, 1)
    m.leave(a.worker_id)
    assert m.join("b", start_clock=9).clock == 9


def test_expire_only_members_older_than_lease(clock: FakeClock) -> None:
    m = make(clock, lease=10.0)
    a = m.join("a")  # t=100
    clock.advance(4)
    b = m.join("b")  # t=104
    clock.advance(6)  # t=110: a exactly lease-old, not older
    assert m.expire() == []
    assert m.expired_total == 0
    clock.advance(0.5)  # a 10.5s old, b 6.5s old
    assert m.expire() == [a]
    assert m.expired_total == 1
    assert m.live_ids() == [b.worker_id]
    clock.advance(10)  # b 16.5s old
    assert m.expire() == [b]
    assert m.expired_total == 2
    assert m.expire() == []
    assert m.expired_total == 2


def test_touch_renews_lease(clock: FakeClock) -> None:
    m = make(clock, lease=10.0)
    a, b = m.join("a"), m.join("b")
    clock.advance(8)
    assert m.touch(a.worker_id) is a
    assert a.last_seen == clock.t
    clock.advance(8)  # a 8s since touch, b 16s
    assert m.expire() == [b]
    assert m.live_ids() == [a.worker_id]


def test_get_unknown_raises(clock: FakeClock) -> None:
    m = make(clock)
    a = m.join("a")
    assert m.get(a.worker_id) is a
    with pytest.raises(UnknownWorker) as info:
        m.get("nope")
    assert "'nope'" in str(info.value)
    with pytest.raises(UnknownWorker):
        m.touch("nope")
    with pytest.raises(UnknownWorker):
        m.advance("nope", 1)
    m.leave(a.worker_id)
    with pytest.raises(UnknownWorker):
        m.get(a.worker_id)


def test_advance_increments_clock_and_samples(clock: FakeClock) -> None:
    m = make(clock)
    a = m.join("a")
    assert (a.clock, a.samples) == (0, 0)
    clock.advance(3)
    m.advance(a.worker_id, 32)
    m.advance(a.worker_id, 16)
    assert (a.clock, a.samples) == (2, 48)
    assert a.last_seen == clock.t  # advancing renews the lease too


def test_join_records_now(clock: FakeClock) -> None:
    m = make(clock)
    clock.advance(2.5)
    a = m.join("a")
    assert a.last_seen == 102.5
    assert a.name == "a"
