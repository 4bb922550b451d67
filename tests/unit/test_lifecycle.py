"""A table's row lifecycle on one shard (sparse/lifecycle.py, sparse/table.py): admission,
capacity with LRU or LFU eviction, TTL, counters kept in checkpoints; initialisers and
unbounded ids."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from paramserver.errors import ConfigError, InvalidRequest
from paramserver.sparse import tablestate
from paramserver.sparse.lifecycle import Lifecycle, Sketch
from paramserver.sparse.optim import RowOptimizerConfig
from paramserver.sparse.rows import Init, initial_rows, table_key
from paramserver.sparse.table import ShardTable, TableSpec

DIM = 4


def table(lifecycle: Lifecycle | None = None, rows: int = 1000, **spec) -> ShardTable:
    return ShardTable(
        TableSpec("t", rows, DIM, **spec),
        RowOptimizerConfig("adam", 0.1),
        seed=2,
        lifecycle=lifecycle,
    )


def push(t: ShardTable, ids, step: int | None = None) -> None:
    ids = np.array(ids, np.int64)
    t.push(ids, torch.ones((len(ids), DIM)), step)


def initial(ids) -> torch.Tensor:
    return torch.from_numpy(initial_rows(table_key(2, "t"), np.array(ids, np.int64), DIM))


def test_admission_drops_and_counts_gradients_until_the_kth_sighting():
    t = table(Lifecycle(admit_after=3))
    push(t, [5, 6])
    push(t, [5])
    assert t.held == 0 and t.tally.dropped == 3 and t.tally.admitted == 0
    torch.testing.assert_close(t.pull([5, 6]), initial([5, 6]))  # the initial value, unstored
    push(t, [5, 7])
    assert t.held == 1 and t.tally.admitted == 1 and t.tally.dropped == 4
    assert not torch.equal(t.pull([5]), initial([5]))  # created and trained by its 3rd push
    fresh = table()
    push(fresh, [5])
    torch.testing.assert_close(t.pull([5]), fresh.pull([5]))  # one step, as a first push


def test_rows_not_held_read_as_zeros_when_declared():
    t = table(Lifecycle(admit_after=2, unadmitted="zeros"))
    push(t, [1])
    assert torch.equal(t.pull([1, 2]), torch.zeros(2, DIM))


def test_a_capacity_evicts_the_least_recent_rows_never_those_of_the_push():
    t = table(Lifecycle(capacity=32, evict="lru"))
    for step in range(1, 11):
        push(t, range(8 * step, 8 * step + 8), step)
        assert t.held <= 32
    held = set(t.index.items()[0].tolist())
    assert set(range(80, 88)) <= held  # the last push's rows
    assert not held & set(range(8, 40))  # the oldest went first
    assert t.tally.evicted == t.tally.admitted - t.held > 0
    assert t.index.slots_used <= 32 + 8  # evicted rows' slots are reused
    # a push with more new rows than the capacity: only as many as fit are created
    dropped = t.tally.dropped
    push(t, range(1000 - 40, 1000), 11)
    assert t.held == 32 and set(t.index.items()[0].tolist()) <= set(range(960, 1000))
    assert t.tally.dropped == dropped + 8


def test_lfu_keeps_the_rows_pushed_most():
    t = table(Lifecycle(capacity=16, evict="lfu"))
    for step in range(1, 6):
        push(t, [0, 1, 2, 3], step)  # hot
    for step in range(6, 16):
        push(t, range(10 * step, 10 * step + 6), step)
    assert {0, 1, 2, 3} <= set(t.index.items()[0].tolist())
    lru = table(Lifecycle(capacity=16, evict="lru"))
    for step in range(1, 6):
        push(lru, [0, 1, 2, 3], step)
    for step in range(6, 16):
        push(lru, range(10 * step, 10 * step + 6), step)
    assert not {0, 1, 2, 3} & set(lru.index.items()[0].tolist())


def test_a_ttl_evicts_rows_not_pushed_for_that_many_steps():
    t = table(Lifecycle(ttl=8))
    push(t, [1, 2], 1)
    for step in range(2, 20):
        push(t, [3], step)
    assert set(t.index.items()[0].tolist()) == {3}
    assert t.tally.evicted == 2


def test_an_evicted_row_starts_again_from_its_initial_value_and_is_counted():
    t = table(Lifecycle(capacity=2))
    push(t, [1], 1)
    push(t, [2, 3], 2)  # 1 goes
    assert 1 not in t.index.items()[0].tolist()
    torch.testing.assert_close(t.pull([1]), initial([1]))  # its optimizer state went too
    push(t, [1], 3)
    assert t.tally.reborn == 1
    fresh = table()
    push(fresh, [1])
    torch.testing.assert_close(t.pull([1]), fresh.pull([1]))


def test_counters_and_the_sketch_survive_a_checkpoint():
    t = table(Lifecycle(admit_after=2, capacity=8))
    for step in range(1, 7):
        push(t, [step, step + 1, 100 + step], step)
    saved = tablestate.state_dict(t)
    back = table(Lifecycle(admit_after=2, capacity=8))
    tablestate.load_state_dict(back, saved)
    ids, slots = t.index.items()
    ids2, slots2 = back.index.items()
    order, order2 = np.argsort(ids), np.argsort(ids2)
    assert ids[order].tolist() == ids2[order2].tolist()
    assert t.hits[slots[order]].tolist() == back.hits[slots2[order2]].tolist()
    assert t.last[slots[order]].tolist() == back.last[slots2[order2]].tolist()
    assert back.tally.state() == t.tally.state()
    push(t, [200, 7], 7)  # 7 was seen once: admitted now on both
    push(back, [200, 7], 7)
    torch.testing.assert_close(t.pull([7, 200]), back.pull([7, 200]))
    assert t.tally.state() == back.tally.state()


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("admit_after", 0),
        ("admit_after", -2),
        ("capacity", -1),
        ("ttl", -5),
        ("evict", "fifo"),
        ("unadmitted", "nan"),
        ("capacity", 2.5),
        ("admit_after", 256),
    ],
)
def test_a_setting_that_makes_no_sense_names_the_table_and_the_value(setting, value):
    with pytest.raises(ConfigError, match=rf"Table 'clicks': {setting}.*{value}"):
        Lifecycle(**{setting: value}).checked("clicks")


def test_a_ttl_sweeps_whenever_its_time_has_come_pushed_or_not():
    """Steps that never land on a multiple of ttl/4, and steps that do not name the table."""
    t = table(Lifecycle(ttl=8))
    push(t, [1], 1)
    for step in range(3, 40, 2):
        push(t, [2], step)
    assert set(t.index.items()[0].tolist()) == {2}
    quiet = table(Lifecycle(ttl=8))
    push(quiet, [1], 1)
    for step in range(2, 20):
        quiet.tick(step)  # other tables' pushes: the server's steps go on
    assert quiet.held == 0 and quiet.tally.evicted == 1


def test_a_checkpoint_resumes_the_lifecycle_as_if_never_stopped():
    """Rows kept, their values and the counters equal a run never interrupted (ties go to
    the smaller id, whatever slot a row sits in)."""
    rng = np.random.default_rng(0)
    for policy in ("lru", "lfu"):
        life = Lifecycle(admit_after=2, capacity=64, evict=policy, ttl=12)
        pushes = [np.unique(rng.zipf(1.3, 40) % 500) for _ in range(120)]
        grads = [torch.randn(len(ids), DIM) for ids in pushes]
        whole, first = table(life, rows=0), table(life, rows=0)
        for step, (ids, g) in enumerate(zip(pushes[:60], grads[:60], strict=True), start=1):
            whole.push(ids, g, step)
            first.push(ids, g, step)
        resumed = table(life, rows=0)
        buffer = io.BytesIO()
        torch.save(tablestate.state_dict(first), buffer)  # as a checkpoint is written and read
        buffer.seek(0)
        tablestate.load_state_dict(resumed, torch.load(buffer, weights_only=True))
        for step, (ids, g) in enumerate(zip(pushes[60:], grads[60:], strict=True), start=61):
            whole.push(ids, g, step)
            resumed.push(ids, g, step)
        everyone = np.arange(500)
        assert sorted(whole.index.items()[0]) == sorted(resumed.index.items()[0])
        assert torch.equal(whole.pull(everyone), resumed.pull(everyone))
        assert whole.tally.state() == resumed.tally.state()


def test_the_sketch_counts_never_less_than_the_truth():
    sketch, truth = Sketch(1024), {}
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = np.unique(rng.integers(0, 5000, 40))
        got = sketch.add(ids)
        for i, c in zip(ids.tolist(), got.tolist(), strict=True):
            truth[i] = truth.get(i, 0) + 1
            assert c >= min(truth[i], 255)


def test_initialisers():
    ids = np.arange(20_000)
    key = table_key(0, "t")
    u = initial_rows(key, ids, 8, "float32", Init.parse("uniform:0.05"))
    assert u.min() >= -0.05 and u.max() < 0.05 and abs(u.mean()) < 1e-3
    n = initial_rows(key, ids, 8, "float32", Init.parse("normal:0.01"))
    assert abs(n.std() - 0.01) < 2e-4
    assert not initial_rows(key, ids[:10], 8, "float32", Init.parse("zeros")).any()
    assert (initial_rows(key, ids[:3], 2, "float64", Init.parse("constant:0.5")) == 0.5).all()
    for text in ("normal", "normal:0.5", "uniform:-1.0:2.0", "zeros", "constant:3.0"):
        assert Init.parse(Init.parse(text).text()) == Init.parse(text)
    for bad in ("gauss", "uniform", "uniform:2:1", "normal:-1", "normal:x", "constant:inf"):
        with pytest.raises(ValueError, match="initialiser"):
            Init.parse(bad)


def test_an_unbounded_table_takes_any_int64_and_a_bounded_one_refuses_them():
    t = table(rows=0)
    ids = np.array([-1, 0, -(2**63), 2**63 - 1, 123456789012345], np.int64)
    push(t, ids)
    assert t.held == 5
    assert not torch.equal(t.pull(ids), initial(ids))
    with pytest.raises(InvalidRequest, match="id -1 is outside"):
        table().pull([-1])
    with pytest.raises(InvalidRequest, match="id 1000 is outside"):
        push(table(), [1000])
    with pytest.raises(InvalidRequest, match="integers"):
        t.pull(np.array([1.5]))
