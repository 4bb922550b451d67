"""The server's side of sparse tables (paramserver/sparse): the id index against a dict,
the shard and initial-row functions, the row optimizers against torch's sparse training,
and bad requests that change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.errors import InvalidRequest
from paramserver.sparse import tablestate
from paramserver.sparse.index import DIRECT_ROWS, DirectIndex, RowIndex, index_for
from paramserver.sparse.lifecycle import Lifecycle
from paramserver.sparse.optim import RowOptimizerConfig
from paramserver.sparse.rows import initial_rows, shard_of, table_key
from paramserver.sparse.table import ShardTable, TableSpec

ROWS, DIM = 500, 8


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-3, 40), max_size=120),
            st.lists(st.integers(-3, 40), max_size=30),
        ),
        max_size=10,
    )
)
def test_the_index_agrees_with_a_dict(steps):
    """Inserts and removals of any int64 (-1 and 0 too); freed slots are reused, so the
    slots handed out never pass the most ids held at once."""
    index = RowIndex(capacity=16)
    _agrees_with_a_dict(index, steps, lambda: len(index) <= 0.7 * index.capacity)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 63), max_size=80), st.lists(st.integers(0, 63), max_size=30)
        ),
        max_size=10,
    )
)
def test_the_direct_index_agrees_with_a_dict(steps):
    """A bounded table's index by id (issue 44: one gather a batch instead of hashed
    probes): the same answers as a dict, freed slots reused first."""
    _agrees_with_a_dict(DirectIndex(64), steps)


def _agrees_with_a_dict(index, steps, holds=lambda: True) -> None:
    """``index`` answers as a dict through ``steps`` (ids inserted, ids removed), and
    ``holds()`` after each step."""
    expected, most = {}, 0
    for batch, gone in steps:
        ids = np.array(batch, np.int64)
        found = index.find(ids)
        assert found.tolist() == [expected.get(i, -1) for i in batch]
        assert index.held_hint(ids).tolist() == [i in expected for i in batch]
        new = np.unique(ids[found < 0])
        for i, slot in zip(new.tolist(), index.insert(new).tolist(), strict=True):
            assert slot not in expected.values()
            expected[i] = slot
        most = max(most, len(expected))
        drop = np.unique(np.array(gone, np.int64))
        freed = index.remove(drop)
        assert sorted(freed.tolist()) == sorted(
            expected.pop(i) for i in drop.tolist() if i in expected
        )
        assert len(index) == len(expected) and index.slots_used <= most
        assert holds()
    ids = np.array(sorted(expected), np.int64)
    assert index.find(ids).tolist() == [expected[i] for i in ids.tolist()]
    held, slots = index.items()
    assert dict(zip(held.tolist(), slots.tolist(), strict=True)) == expected
    assert slots.tolist() == sorted(slots.tolist())


def test_a_table_indexes_by_id_only_when_bounded_small_and_never_evicting():
    assert isinstance(index_for(1000, bounded=False), DirectIndex)
    assert isinstance(index_for(DIRECT_ROWS, bounded=False), DirectIndex)
    assert isinstance(index_for(DIRECT_ROWS + 1, bounded=False), RowIndex)  # 64 MiB at most
    assert isinstance(index_for(0, bounded=False), RowIndex)  # unbounded: any int64 id
    assert isinstance(index_for(1000, bounded=True), RowIndex)  # evictions scan items()
    capped = ShardTable(
        TableSpec("t", ROWS, DIM), RowOptimizerConfig("sgd", 0.1), lifecycle=Lifecycle(capacity=8)
    )
    assert isinstance(capped.index, RowIndex)
    assert isinstance(
        ShardTable(TableSpec("t", ROWS, DIM), RowOptimizerConfig("sgd", 0.1)).index, DirectIndex
    )


def test_rows_spread_over_shards_and_start_the_same_whatever_the_sharding():
    ids = np.arange(100_000)
    counts = np.bincount(shard_of(ids, 4), minlength=4)
    assert counts.min() > 0.24 * len(ids) and counts.max() < 0.26 * len(ids)
    key = table_key(7, "user")
    whole = initial_rows(key, ids[:4000], 16)
    parts = [initial_rows(key, ids[i : i + 1000][::-1], 16)[::-1] for i in range(0, 4000, 1000)]
    np.testing.assert_array_equal(whole, np.concatenate(parts))
    assert abs(whole.mean()) < 0.02 and abs(whole.std() - 1) < 0.02  # N(0, 1), like nn.Embedding
    assert not np.array_equal(whole, initial_rows(table_key(8, "user"), ids[:4000], 16))
    assert not np.array_equal(whole, initial_rows(table_key(7, "item"), ids[:4000], 16))


def _torch_twin(table: ShardTable, name: str, lr: float):
    emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(table.read(np.arange(ROWS)))
    params = [emb.weight]
    opt = {
        "sgd": lambda: torch.optim.SGD(params, lr=lr),
        "adagrad": lambda: torch.optim.Adagrad(params, lr=lr),
        "adam": lambda: torch.optim.SparseAdam(params, lr=lr),
    }[name]()
    return emb, opt


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's Adagrad, inside
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_row_optimizers_train_a_table_as_torch_trains_a_sparse_embedding(name):
    lr = 0.05
    table = ShardTable(TableSpec("t", ROWS, DIM), RowOptimizerConfig(name, lr), seed=3, reserve=16)
    emb, opt = _torch_twin(table, name, lr)
    rng = np.random.default_rng(0)
    touched: set[int] = set()
    for step in range(30):
        batch = rng.zipf(1.3, size=64) % ROWS  # skewed, with repeats, as real ids are
        touched |= set(batch.tolist())
        rows = table.pull(batch)
        # sgd and adagrad bit for bit; lazy adam to an ulp or so (torch's sparse ops order)
        torch.testing.assert_close(
            rows, emb(torch.from_numpy(batch)).detach(), rtol=1e-6, atol=1e-6
        )
        ids = np.unique(batch)
        grads = torch.from_numpy(rng.standard_normal((len(ids), DIM)).astype(np.float32))
        table.push(ids, grads)
        opt.zero_grad()
        emb.weight.grad = torch.sparse_coo_tensor(
            torch.from_numpy(ids)[None], grads, (ROWS, DIM), check_invariants=True
        )
        opt.step()
        if step == 10:
            table.push(np.array([], np.int64), torch.empty(0, DIM))  # an empty push is a step
            emb.weight.grad = torch.sparse_coo_tensor(
                torch.empty(1, 0, dtype=torch.long),
                torch.empty(0, DIM),
                (ROWS, DIM),
                check_invariants=True,
            )
            opt.step()
    torch.testing.assert_close(
        table.read(np.arange(ROWS)), emb.weight.detach(), rtol=1e-6, atol=1e-7
    )
    assert table.held == len(touched) < ROWS  # untouched rows were never created


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise-adagrad", "adam"])
def test_a_table_trains_the_same_on_1_2_and_3_shards(name):
    """A push reaches only the shards holding its rows (a shard it carries no row for does
    not step): each row's optimizer state, lazy adam's step count included, is its own,
    so 1, 2 and 3 shards end equal."""
    cfg = RowOptimizerConfig(name, 0.01)
    ends = []
    for count in (1, 2, 3):
        shards = [
            ShardTable(TableSpec("t", ROWS, DIM), cfg, seed=1, shard=i, shards=count)
            for i in range(count)
        ]
        rng = np.random.default_rng(1)
        for _ in range(10):
            ids = np.unique(rng.zipf(1.5, 30) % ROWS)
            grads = torch.from_numpy(rng.standard_normal((len(ids), DIM)).astype(np.float32))
            owner = shard_of(ids, count)
            for i, table in enumerate(shards):
                if (owner == i).any():
                    table.push(ids[owner == i], grads[torch.from_numpy(owner == i)])
        ids = np.arange(ROWS)
        owner = shard_of(ids, count)
        got = torch.empty(ROWS, DIM)
        for i, table in enumerate(shards):
            got[torch.from_numpy(owner == i)] = table.read(ids[owner == i])
        ends.append(got)
    torch.testing.assert_close(ends[1], ends[0], rtol=0, atol=0)
    torch.testing.assert_close(ends[2], ends[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["rowwise-adagrad", "adam"])
def test_rowwise_adagrad_and_lazy_adam_follow_their_definitions(name):
    """rowwise-adagrad keeps one accumulator a row (its state is (rows, 1)); lazy adam
    corrects each row's bias by its own steps. Both against tests/unit/rowref.py, which
    steps one row at a time from the definition."""
    from tests.unit.rowref import Reference

    lr = 0.05
    table = ShardTable(TableSpec("t", ROWS, DIM), RowOptimizerConfig(name, lr), seed=4, reserve=8)
    ref = Reference(table.read(np.arange(ROWS)), name, lr)
    rng = np.random.default_rng(2)
    for _ in range(25):
        ids = np.unique(rng.zipf(1.3, size=40) % ROWS)
        grads = torch.from_numpy(rng.standard_normal((len(ids), DIM)).astype(np.float32))
        table.push(ids, grads)
        ref.step(ids.tolist(), grads)
    table.push(np.array([], np.int64), torch.empty(0, DIM))  # a push of no rows steps none
    torch.testing.assert_close(
        table.read(np.arange(ROWS)), ref.values.float(), rtol=1e-5, atol=1e-6
    )
    widths = [s.shape[1] for s in table.state]
    assert widths == ([1] if name == "rowwise-adagrad" else [DIM, DIM, 1])


def test_bad_requests_are_refused_and_change_nothing():
    table = ShardTable(
        TableSpec("t", ROWS, DIM), RowOptimizerConfig("adagrad", 0.1), shard=1, shards=2
    )
    mine = np.arange(ROWS)[shard_of(np.arange(ROWS), 2) == 1]
    table.push(mine[:5], torch.ones(5, DIM))
    before = tablestate.state_dict(table)
    other = np.arange(ROWS)[shard_of(np.arange(ROWS), 2) == 0][:1]
    bad = [
        ((np.array([-1]), torch.ones(1, DIM)), "outside"),
        ((np.array([ROWS]), torch.ones(1, DIM)), "outside"),
        ((np.array([1.5]), torch.ones(1, DIM)), "integers"),
        ((mine[:4].reshape(2, 2), torch.ones(4, DIM)), "1-D"),
        ((other, torch.ones(1, DIM)), "belongs to shard 0"),
        ((np.array([mine[0], mine[0]]), torch.ones(2, DIM)), "twice"),
        ((mine[:2], torch.ones(2, DIM + 1)), "expected"),
        ((mine[:2], torch.ones(2, DIM, dtype=torch.float64)), "expected"),
        ((mine[:2], torch.ones(3, DIM)), "expected"),
        ((mine[:2], torch.tensor([[float("nan")] * DIM] * 2)), "NaN"),
    ]
    for (ids, grads), why in bad:
        with pytest.raises(InvalidRequest, match=why):
            table.push(ids, grads)
    for ids in (np.array([-3]), other, np.array(["a"])):
        with pytest.raises(InvalidRequest):
            table.pull(ids)
    after = tablestate.state_dict(table)
    assert after["steps"] == before["steps"] == 1
    for key in ("ids", "values"):
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0)
    torch.testing.assert_close(after["state"][0], before["state"][0], rtol=0, atol=0)


def test_a_saved_table_restores_and_trains_on_identically():
    cfg = RowOptimizerConfig("adam", 0.02)
    a = ShardTable(TableSpec("t", ROWS, DIM), cfg, seed=5)
    rng = np.random.default_rng(2)

    def step(table: ShardTable, r: np.random.Generator) -> None:
        ids = np.unique(r.integers(0, ROWS, 40))
        table.push(ids, torch.from_numpy(r.standard_normal((len(ids), DIM)).astype(np.float32)))

    for _ in range(5):
        step(a, rng)
    b = ShardTable(TableSpec("t", ROWS, DIM), cfg, seed=5)
    tablestate.load_state_dict(b, tablestate.state_dict(a))
    for _ in range(5):
        state = rng.bit_generator.state
        step(a, rng)
        rng2 = np.random.default_rng()
        rng2.bit_generator.state = state
        step(b, rng2)
    ids = np.arange(ROWS)
    torch.testing.assert_close(b.read(ids), a.read(ids), rtol=0, atol=0)
    assert b.held == a.held


def test_a_huge_table_costs_only_the_rows_touched():
    table = ShardTable(TableSpec("big", 10**12, 64), RowOptimizerConfig("sgd", 0.1))
    ids = np.array([0, 5, 10**12 - 1, 123_456_789_012])
    rows = table.pull(ids)
    assert rows.shape == (4, 64) and table.held == 0  # a pull creates no row
    table.push(ids, torch.ones(4, 64))
    assert table.held == 4
    assert table.values.numel() * 4 < 2**20  # a MiB at most, for a table of 256 TB
    torch.testing.assert_close(table.read(ids), rows - 0.1, rtol=0, atol=1e-6)


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=3), limit=st.integers(1, 600))
def test_rows_split_into_chunks_read_back_as_the_header_held_them(sizes, limit):
    """``split_rows`` cuts a header's rows into chunks of at most ``limit`` bytes (a row
    each at least), and the server reads the chunks back as the same rows, a table each."""
    from paramserver._proto import paramserver_pb2 as pb
    from paramserver.codec import rows as wire
    from paramserver.sparse.tableset import RowGradients

    specs = {f"t{i}": TableSpec(f"t{i}", 1000, 3) for i in range(len(sizes))}
    g = torch.Generator().manual_seed(sum(sizes))
    pushes = [
        RowGradients(f"t{i}", np.arange(n, dtype=np.int64) * 7, torch.randn(n, 3, generator=g))
        for i, n in enumerate(sizes)
    ]
    header = pb.PushHeader(worker_id="w", rows=[wire.gradients_to_proto(p) for p in pushes])
    before = header.SerializeToString()
    sent, chunks = wire.split_rows(header, limit)
    assert header.SerializeToString() == before  # a retry sends the header as it was
    if header.ByteSize() <= limit:
        assert sent is header and chunks == []
        got = wire.gradients_from_proto(sent.rows, specs)
    else:
        assert not sent.rows and sent.row_chunks == len(chunks) >= len(sizes)
        row = pb.RowGradients(table="t0", ids=b"\0" * 8, values=b"\0" * 12).ByteSize()
        assert all(c.ByteSize() <= max(limit, row) for c in chunks)
        got = wire.gradients_from_proto((), specs, chunks)
    for want, have in zip(pushes, got, strict=True):
        assert have.table == want.table
        np.testing.assert_array_equal(have.ids, want.ids)
        torch.testing.assert_close(have.grads, want.grads, rtol=0, atol=0)
