"""The chaos run's fault schedule: seeded, every kind once before any twice, targets in
range, holds as documented; and the kinds' names."""

from __future__ import annotations

import pytest

from paramserver.cluster.faults import KINDS, WORKER_KINDS, parse_kinds, schedule


def test_a_schedule_is_seeded_and_takes_every_kind_before_repeating_one():
    one = schedule(7, 30, KINDS, shards=2, workers=3, lease=3.0)
    assert one == schedule(7, 30, KINDS, shards=2, workers=3, lease=3.0)
    assert one != schedule(8, 30, KINDS, shards=2, workers=3, lease=3.0)
    assert len(one) == 30
    for lo in range(0, 30 - len(KINDS) + 1, len(KINDS)):
        assert sorted(f.kind for f in one[lo : lo + len(KINDS)]) == sorted(KINDS)
    for f in one:
        if f.kind in WORKER_KINDS:
            assert 0 <= f.target < 3
        elif f.kind == "kill-all-shards":
            assert f.target == -1
        else:
            assert 0 <= f.target < 2
        if f.kind == "stop-worker":
            assert f.hold > 3.0  # past the lease
        if f.kind in ("stop-shard", "disk-full"):
            assert 2.0 <= f.hold <= 4.0
        if f.kind == "link-down":
            assert 1.5 <= f.hold <= 6.0


def test_kinds_are_named_or_refused():
    assert parse_kinds("all") == KINDS
    assert "kill-worker" not in parse_kinds("server")
    assert parse_kinds("disk-full,kill-shard,disk-full") == ("disk-full", "kill-shard")
    with pytest.raises(ValueError, match="Unknown fault kind 'kill-everything'"):
        parse_kinds("kill-everything")
