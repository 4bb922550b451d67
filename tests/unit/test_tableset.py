"""The tables of one server shard as the coordinator will use them (sparse/tableset.py):
pushes checked whole before anything changes, and the sync round's row gradients averaged
so that a round equals one large-batch step of torch's sparse training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from paramserver.errors import InvalidRequest
from paramserver.sparse import initial as initial_module
from paramserver.sparse.optim import RowOptimizerConfig
from paramserver.sparse.row_round import RowRound
from paramserver.sparse.rows import initial_rows, shard_of
from paramserver.sparse.table import TableSpec
from paramserver.sparse.tableset import RowGradients, TableSet, row_optimizer
from tests.unit.rowref import Reference

ROWS, DIM = 200, 4
SPECS = [TableSpec("a", ROWS, DIM), TableSpec("b", ROWS, DIM)]


def _rows(n: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(ROWS, generator=g)[:n].numpy()
    return ids, torch.randn(n, DIM, generator=g)


def test_a_push_with_one_bad_table_changes_no_table():
    tables = TableSet(SPECS, row_optimizer("sgd", 0.1), seed=1)
    before = {name: tables.table(name).read(np.arange(ROWS)) for name in ("a", "b")}
    good = RowGradients("a", *_rows(5, 0))
    bad_pushes = [
        [good, RowGradients("b", np.array([1, 1]), torch.zeros(2, DIM))],  # duplicate id
        [good, RowGradients("b", np.array([ROWS]), torch.zeros(1, DIM))],  # out of range
        [good, RowGradients("b", np.array([3]), torch.zeros(1, DIM + 1))],  # wrong dim
        [good, RowGradients("b", np.array([3]), torch.full((1, DIM), float("nan")))],
        [good, RowGradients("c", np.array([3]), torch.zeros(1, DIM))],  # no such table
        [good, good],  # a table twice
    ]
    for pushes in bad_pushes:
        with pytest.raises(InvalidRequest):
            tables.apply(tables.check(pushes))
    for name in ("a", "b"):
        torch.testing.assert_close(tables.table(name).read(np.arange(ROWS)), before[name])
    assert tables.held == 0 and tables.rows_pushed == 0
    with pytest.raises(InvalidRequest, match="No table 'c' is held here"):
        tables.pull("c", [0])


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "sparse-adam"])
def test_a_sync_round_of_row_gradients_is_one_large_batch_step(optimizer):
    """Two workers' half batches through a round and its mean equal torch's sparse
    embedding trained on the whole batch (the mean loss over both halves)."""
    lr, steps = 0.05, 4
    tables = TableSet([SPECS[0]], RowOptimizerConfig(optimizer, lr), seed=2)
    emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(tables.table("a").read(np.arange(ROWS)))
    # the whole batch through torch's SGD or SparseAdam, or through lazy adam from its
    # definition (each row bias-corrected by its own steps: tests/unit/rowref.py)
    ref = Reference(emb.weight.detach(), "adam", lr) if optimizer == "adam" else None
    opt: torch.optim.Optimizer = torch.optim.SGD([emb.weight], lr=lr)
    if optimizer == "sparse-adam":
        opt = torch.optim.SparseAdam([emb.weight], lr=lr)
    g = torch.Generator().manual_seed(5)
    target = torch.randn(ROWS, DIM, generator=g)
    rnd = RowRound()
    for _ in range(steps):
        batch = torch.randint(0, ROWS, (32,), generator=g)
        opt.zero_grad()
        F.mse_loss(emb(batch), target[batch]).backward()
        if ref is None:
            opt.step()
        else:
            whole = emb.weight.grad.coalesce()
            ref.step(whole.indices()[0].tolist(), whole.values())
            with torch.no_grad():
                emb.weight.copy_(ref.values.float())
        pushes = []
        for half in (batch[:16], batch[16:]):  # each worker's own mean loss
            ids, inverse = torch.unique(half, return_inverse=True)
            rows = tables.pull("a", ids.numpy()).requires_grad_()
            F.mse_loss(F.embedding(inverse, rows), target[half]).backward()
            pushes.append(tables.check([RowGradients("a", ids.numpy(), rows.grad)]))
        for checked in pushes:
            rnd.add(checked)
        rnd = RowRound.from_state(rnd.state())  # a round survives a checkpoint
        tables.apply(rnd.take_mean(2))
    torch.testing.assert_close(
        tables.table("a").read(np.arange(ROWS)), emb.weight.detach(), rtol=1e-5, atol=1e-6
    )
    assert rnd.take_mean(2) == []  # the round started afresh


def test_tables_save_and_restore_and_refuse_another_runs_tables():
    tables = TableSet(SPECS, row_optimizer("adamw", 0.01), seed=3, shard=1, shards=2)
    ids = np.array([i for i in range(ROWS) if _shard(i) == 1][:6])  # shard 1's rows
    tables.apply(tables.check([RowGradients("a", ids, torch.ones(len(ids), DIM))]))
    copy = TableSet(SPECS, row_optimizer("adam", 0.01), seed=3, shard=1, shards=2)
    copy.load_state_dict(tables.state_dict())
    torch.testing.assert_close(copy.table("a").read(ids), tables.table("a").read(ids))
    assert copy.held == tables.held == len(ids)
    with pytest.raises(ValueError, match="not this run's"):
        TableSet(SPECS[:1], row_optimizer("sgd", 0.1)).load_state_dict(tables.state_dict())


def _shard(i: int) -> int:
    return int(shard_of(np.array([i]), 2)[0])


def test_row_optimizers_follow_the_servers_optimizer():
    assert row_optimizer("adamw", 0.1).name == "sparse-adam"
    assert row_optimizer("momentum", 0.1).name == "sgd"
    with pytest.raises(ValueError, match="No row-wise optimizer"):
        row_optimizer("lbfgs", 0.1)
    with pytest.raises(ValueError, match="share a name"):
        TableSet([SPECS[0], SPECS[0]], row_optimizer("sgd", 0.1))


def test_whole_tables_are_the_held_rows_over_the_seeded_initial_values():
    from paramserver.sparse.rows import initial_rows
    from paramserver.sparse.tableset import whole_tables

    spec = TableSpec("t", 50, 4)
    tables = TableSet([spec], row_optimizer("sgd", 0.5), seed=3)
    tables.apply(tables.check([RowGradients("t", np.array([7, 2]), torch.ones(2, 4))]))
    whole = whole_tables(tables.layouts(), [tables.state_dict()])["t.weight"]
    expected = torch.from_numpy(initial_rows(tables.table("t").key, np.arange(50), 4))
    expected[[7, 2]] -= 0.5
    torch.testing.assert_close(whole, expected, rtol=0, atol=0)
    assert whole_tables(tables.layouts(), [tables.state_dict()], limit=50 * 4 * 4 - 1) == {}
    sharded = TableSet([spec], row_optimizer("sgd", 0.5), shard=0, shards=2)
    assert whole_tables(sharded.layouts(), [sharded.state_dict()]) == {}
    # every shard's rows make the same whole table as the single server's
    from paramserver.sparse.rows import shard_of

    ids = np.array([7, 2])
    shards = [
        TableSet([spec], row_optimizer("sgd", 0.5), seed=3, shard=i, shards=2) for i in range(2)
    ]
    for i, part in enumerate(shards):
        mine = ids[shard_of(ids, 2) == i]
        part.apply(part.check([RowGradients("t", mine, torch.ones(len(mine), 4))]))
    layouts = shards[0].layouts()
    both = whole_tables(layouts, [p.state_dict() for p in shards])["t.weight"]
    torch.testing.assert_close(both, expected, rtol=0, atol=0)


def test_a_pull_creates_no_row_and_no_optimizer_state(monkeypatch):
    """Rows come into being with their first push: a pull of ids never pushed gives their
    initial values and stores nothing (issue 27: 1.6M ids pulled held 1.6M rows)."""

    tables = TableSet(SPECS, row_optimizer("adam", 0.1), seed=3)
    ids = np.array([5, 7, 5, 199, 0])
    pulled = tables.pull("a", ids)
    assert tables.held == 0 and tables.rows_pulled == len(ids)
    initial = tables.table("a").read(np.arange(ROWS))
    torch.testing.assert_close(pulled, initial[torch.from_numpy(ids)])
    before = tables.table("a").state[0].clone()
    tables.apply(tables.check([RowGradients("a", np.array([7, 9]), torch.ones(2, DIM))]))
    assert tables.held == 2
    again = tables.pull("a", ids)
    assert not torch.equal(again[1], pulled[1])  # row 7 was stepped
    torch.testing.assert_close(again[[0, 2, 3, 4]], pulled[[0, 2, 3, 4]])
    assert tables.table("a").state[0].shape == before.shape  # no state grown by the pulls
    # the initial values are computed a bounded chunk at a time, to the same values
    monkeypatch.setattr(initial_module, "INITIAL_CHUNK", 3)
    torch.testing.assert_close(
        tables.table("a").read(np.arange(ROWS)), tables.pull_many([("a", np.arange(ROWS))])[0]
    )
    unheld = np.setdiff1d(np.arange(ROWS), [7, 9])
    torch.testing.assert_close(tables.pull("a", unheld), initial[torch.from_numpy(unheld)])


def test_each_table_takes_the_optimizer_table_optimizer_names():
    from paramserver.config import ServerConfig, parse_table_optimizers
    from paramserver.errors import ConfigError
    from paramserver.sparse.tableset import table_optimizers

    chosen = parse_table_optimizers("a=rowwise-adagrad:0.05, adagrad")
    got = table_optimizers(SPECS, chosen, "adam", 0.001)
    assert got["a"][0].name == "rowwise-adagrad" and got["a"][0].lr == 0.05 and not got["a"][1]
    assert got["b"][0].name == "adagrad" and got["b"][0].lr == 0.001 and got["b"][1]
    plain = table_optimizers(SPECS, {}, "adamw", 0.01)
    assert {n: (c.name, s) for n, (c, s) in plain.items()} == {
        "a": ("sparse-adam", True),
        "b": ("sparse-adam", True),
    }
    with pytest.raises(ConfigError, match="'c', which the model does not hold"):
        table_optimizers(SPECS, parse_table_optimizers("c=sgd"), "adam", 0.1)
    for bad, needle in [
        ("lbfgs", "'lbfgs' is not a row optimizer"),
        ("a=adam:0", "must be a positive number; got '0'"),
        ("a=adam:fast", "got 'fast'"),
        ("a=sgd,a=adam", "names table 'a' twice"),
        ("sgd,adam", "names the default twice"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            ServerConfig(table_optimizer=bad)
    # a table with its own rate keeps it; the others follow the server's schedule
    tables = TableSet(SPECS, got, seed=1)
    ids = np.array([3])
    before = tables.pull_many([("a", ids), ("b", ids)])
    tables.apply(
        tables.check(
            [RowGradients("a", ids, torch.ones(1, DIM)), RowGradients("b", ids, torch.ones(1, DIM))]
        ),
        lr=0.0,
    )
    after = tables.pull_many([("a", ids), ("b", ids)])
    assert not torch.equal(after[0], before[0])  # its own 0.05, not the schedule's 0
    torch.testing.assert_close(after[1], before[1])  # the schedule's rate, 0 here


def test_a_checkpoint_of_lazy_adam_before_per_row_steps_resumes_each_row_from_the_tables():
    tables = TableSet(SPECS[:1], RowOptimizerConfig("adam", 0.01), seed=3)
    ids = np.array([1, 2, 3])
    for _ in range(4):
        tables.apply(tables.check([RowGradients("a", ids, torch.ones(3, DIM))]))
    saved = tables.state_dict()
    saved["a"]["state"] = saved["a"]["state"][:2]  # as written before: the moments only
    old = TableSet(SPECS[:1], RowOptimizerConfig("adam", 0.01), seed=3)
    old.load_state_dict(saved)
    assert old.table("a").state[2][: len(ids)].flatten().tolist() == [4, 4, 4]
    for t in (tables, old):
        t.apply(t.check([RowGradients("a", ids, torch.ones(3, DIM))]))
    torch.testing.assert_close(old.pull("a", ids), tables.pull("a", ids), rtol=0, atol=0)


def _count_initial_rows(monkeypatch) -> list[int]:
    """The number of ids of each ``initial_rows`` call from now on."""
    real, calls = initial_module.initial_rows, []

    def counted(*args, **kwargs):
        calls.append(len(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(initial_module, "initial_rows", counted)
    return calls


def test_a_push_s_new_rows_start_from_values_computed_before_the_lock(monkeypatch):
    """``check`` (outside the coordinator's lock) computes the initial values of the rows
    not held yet; ``apply`` (under it) computes none, also for a sync round's mean."""
    calls = _count_initial_rows(monkeypatch)
    tables = TableSet(SPECS, row_optimizer("sgd", 0.1), seed=1)
    ids, grads = _rows(30, 0)
    first = tables.check([RowGradients("a", ids[:20], grads[:20])])
    second = tables.check([RowGradients("a", ids[10:], grads[10:])])
    assert calls == [20, 20]
    rnd = RowRound()
    rnd.add(first)
    rnd.add(second)
    tables.apply(rnd.take_mean(2), step=1)
    assert calls == [20, 20]  # the round's 30 new rows came prepared
    ref = TableSet(SPECS, row_optimizer("sgd", 0.1), seed=1)
    ref.table("a").push(*_coalesced(ids, grads))
    torch.testing.assert_close(tables.table("a").read(ids), ref.table("a").read(ids))
    # a row created after its push was checked is not created twice, nor from stale values
    late = tables.check([RowGradients("a", ids[:5], grads[:5])])
    tables.apply(tables.check([RowGradients("a", ids[:5], grads[:5])]), step=2)
    held = tables.table("a").read(ids[:5])
    tables.apply(late, step=3)
    torch.testing.assert_close(tables.table("a").read(ids[:5]), held - 0.1 * grads[:5])


def _coalesced(ids: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """The round's mean of the two pushes above: rows 10..19 in both."""
    total = grads.clone()
    total[10:20] *= 2
    return ids, total / 2


def test_the_index_hint_is_right_for_ids_no_concurrent_change_touches():
    import threading

    from paramserver.sparse.index import RowIndex

    index = RowIndex(16)
    held = np.arange(0, 2000, 2, dtype=np.int64)
    index.insert(held)
    absent = held + 1
    stop = threading.Event()

    def churn() -> None:
        n = 0
        while not stop.is_set():  # other ids come and go, with rebuilds
            ids = np.arange(10**6 + n, 10**6 + n + 500, dtype=np.int64)
            index.insert(ids)
            index.remove(ids[::2])
            n += 500

    writer = threading.Thread(target=churn, daemon=True)
    writer.start()
    try:
        for _ in range(200):
            assert index.held_hint(held).all() and not index.held_hint(absent).any()
    finally:
        stop.set()
        writer.join(timeout=30)


@pytest.mark.parametrize("chunk", [3, 1 << 16])
def test_many_tables_initial_values_in_one_pass_equal_each_tables_own(monkeypatch, chunk):
    """A pull or a push of many tables computes the initial rows of all of them in one
    pass (a key per id, chunks crossing the tables' boundaries): the values each table's
    own computation gives, for tables of one width and of two."""
    monkeypatch.setattr(initial_module, "INITIAL_CHUNK", chunk)
    specs = [TableSpec(f"t{i}", 50, 8 if i < 3 else 4) for i in range(5)]
    tables = TableSet(specs, RowOptimizerConfig("adam", 0.1))
    rng = np.random.default_rng(3)
    wanted = [(spec.name, rng.choice(50, 7, replace=False)) for spec in specs]
    together = tables.pull_many(wanted)
    for (name, ids), got in zip(wanted, together, strict=True):
        table = tables.table(name)
        own = torch.from_numpy(
            initial_rows(table.key, ids, table.spec.dim, table.spec.dtype, table.init)
        )
        assert torch.equal(got, own), name
    pushed = [
        RowGradients(name, ids, torch.ones(len(ids), s.dim))
        for (name, ids), s in zip(wanted, specs, strict=True)
    ]
    for push, (name, ids), got in zip(tables.check(pushed), wanted, together, strict=True):
        fresh, values = push.prepared
        assert np.array_equal(fresh, np.sort(ids))
        assert torch.equal(values, got[torch.from_numpy(np.argsort(ids))]), name


def test_adam_s_two_forms_resume_each_other_s_rows():
    """A run saved under lazy adam (each row's steps) resumes under sparse-adam (the
    table's; the default for --optimizer adam since issue 44) with the same moments, and
    back, each row's steps then its pushes; another optimizer's state is refused."""
    import dataclasses

    from paramserver.sparse import tablestate

    ids = np.array([1, 2, 3])
    lazy = TableSet(SPECS[:1], RowOptimizerConfig("adam", 0.01), seed=3)
    for n in range(3):
        pushed = ids[: n + 1]
        lazy.apply(lazy.check([RowGradients("a", pushed, torch.ones(len(pushed), DIM))]))
    block = lazy.take_changes()["a"].rows
    table = TableSet(SPECS[:1], RowOptimizerConfig("sparse-adam", 0.01), seed=3).table("a")
    tablestate.put_rows(table, block)
    slots = torch.from_numpy(table.index.find(ids))
    assert len(table.state) == 2
    for mine, theirs in zip(table.state, block.state[:2], strict=True):
        torch.testing.assert_close(mine[slots], theirs, rtol=0, atol=0)
    back = TableSet(SPECS[:1], RowOptimizerConfig("adam", 0.01), seed=3).table("a")
    tablestate.put_rows(back, dataclasses.replace(block, state=block.state[:2]))
    at = torch.from_numpy(back.index.find(ids))
    assert back.state[2][at].flatten().tolist() == [3, 2, 1]  # each row's pushes
    torch.testing.assert_close(back.state[0][at], block.state[0], rtol=0, atol=0)
    other = TableSet(SPECS[:1], RowOptimizerConfig("rowwise-adagrad", 0.01), seed=3).table("a")
    with pytest.raises(ValueError, match="has 3 parts; rowwise-adagrad keeps 1"):
        tablestate.put_rows(other, block)


def test_a_push_takes_its_new_rows_initial_values_from_the_pull_before_it(monkeypatch):
    """Issue 44: the initial values a row pull computed for the rows not held are kept (the
    shard's ``Recent``), and the push of those rows that follows computes none; the rows
    it creates hold the same values as where nothing was kept."""
    calls = _count_initial_rows(monkeypatch)
    tables = TableSet(SPECS, row_optimizer("sgd", 0.1), seed=4)
    ids, grads = _rows(25, 1)
    pulled = tables.pull_many([("a", ids), ("b", ids[:5])])
    assert sorted(calls) == [5, 25] or calls == [30]  # one pass over both tables
    calls.clear()
    tables.apply(
        tables.check([RowGradients("a", ids, grads), RowGradients("b", ids[:5], grads[:5])])
    )
    assert calls == []  # every new row's initial value came from the pull
    assert tables.recent.hits == 30 and tables.recent.misses == 0
    torch.testing.assert_close(tables.table("a").read(ids), pulled[0] - 0.1 * grads)
    fresh = TableSet(SPECS, row_optimizer("sgd", 0.1), seed=4)  # nothing kept
    fresh.apply(fresh.check([RowGradients("a", ids, grads)]))
    torch.testing.assert_close(
        fresh.table("a").read(ids), tables.table("a").read(ids), rtol=0, atol=0
    )


def test_recent_initial_values_are_bounded_and_come_back_in_the_order_asked():
    from paramserver.sparse.initial import Recent

    group = (7, 2, "float32", None, False)
    block = 3 * 2 * 4 + 3 * 8  # 3 rows of 2 float32 and their ids
    recent = Recent(blocks=2, budget=3 * block)
    for first in (0, 10, 20):
        ids = np.array([first + 2, first, first + 1])  # unsorted: kept sorted
        recent.keep(group, ids, torch.tensor([[2.0, 2], [0, 0], [1, 1]]) + first)
    found, values = recent.take(group, np.array([21, 5, 12, 20, 1]))
    assert found.tolist() == [True, False, True, True, False]  # block 0 went (2 a table)
    assert values is not None and values[:, 0].tolist() == [21.0, 12.0, 20.0]
    other = (8, 2, "float32", None, False)
    for first in (0, 3):  # another table's two: the budget drops the first table's oldest
        recent.keep(other, np.arange(first, first + 3), torch.zeros(3, 2))
    assert recent.take(group, np.array([12, 20]))[0].tolist() == [False, True]
    assert recent.bytes == 3 * block
