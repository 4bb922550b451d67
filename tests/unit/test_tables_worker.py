"""The worker's side of sparse tables (paramserver/sparse/embedding.py): a model whose
sparse embeddings are replaced by tables trains exactly as torch trains it locally, the
cache stays bounded, and prefetched rows count as hits without breaking exactness."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.errors import ConfigError
from paramserver.sparse.client import LocalTables
from paramserver.sparse.embedding import TableEmbedding, attach_tables, table_specs
from paramserver.sparse.optim import RowOptimizerConfig
from paramserver.sparse.table import ShardTable, TableSpec
from tests import sparse_models

ROWS, DIM, FIELDS = 300, 8, 3


def Clicky() -> nn.Module:  # noqa: N802 - stands for the class
    return sparse_models.Clicky(ROWS, DIM, FIELDS, bag_mode="mean")


def _shards(specs: list[TableSpec], shards: int, optimizer: RowOptimizerConfig) -> LocalTables:
    return LocalTables(
        {
            s.name: [
                ShardTable(s, optimizer, seed=7, shard=i, shards=shards) for i in range(shards)
            ]
            for s in specs
        }
    )


def _batches(steps: int, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    # skewed ids, so batches repeat rows within and across steps
    ids = (torch.rand(steps, batch, FIELDS, generator=g) ** 3 * ROWS).long()
    return [(ids[i], (ids[i].sum(1) % 2)) for i in range(steps)]


@pytest.mark.parametrize("prefetch", [False, True])
def test_tables_train_the_model_as_torch_trains_its_sparse_embeddings(prefetch):
    torch.manual_seed(1)
    local = Clicky()
    remote = Clicky()
    remote.load_state_dict(local.state_dict())
    # adagrad: a row state that torch's sparse optimizer keeps the same way (lazy adam's
    # per-row steps differ from SparseAdam's table-wide count by design: test_sparse.py)
    tables = _shards(table_specs(remote), 3, RowOptimizerConfig("adagrad", 0.05))
    with torch.no_grad():  # both start from the tables' seeded rows
        for name in ("emb", "bag"):
            whole = torch.cat([tables.pull(name, np.arange(ROWS))])
            getattr(local, name).weight.copy_(whole)
    attached = attach_tables(remote, tables, cache_rows=200)
    assert set(attached) == {"emb", "bag"} and isinstance(remote.emb, TableEmbedding)
    assert [n for n, _ in remote.named_parameters()] == ["head.weight", "head.bias"]

    sparse_opt = torch.optim.Adagrad([local.emb.weight, local.bag.weight], lr=0.05)
    dense_local = torch.optim.Adam(local.head.parameters(), lr=0.01)
    dense_remote = torch.optim.Adam(remote.head.parameters(), lr=0.01)
    batches = _batches(12)
    for i, (x, y) in enumerate(batches):
        F.cross_entropy(local(x), y).backward()
        sparse_opt.step()
        dense_local.step()
        sparse_opt.zero_grad()
        dense_local.zero_grad()

        F.cross_entropy(remote(x), y).backward()
        if prefetch and i + 1 < len(batches):  # the next batch's rows, before this push
            for m in attached.values():
                m.prefetch(batches[i + 1][0])
        pushed = sum(m.push() for m in attached.values())
        assert pushed == len(x.unique()) * 2
        dense_remote.step()
        dense_remote.zero_grad()

    for name in ("emb", "bag"):
        torch.testing.assert_close(
            tables.pull(name, np.arange(ROWS)),
            getattr(local, name).weight.detach(),
            rtol=1e-5,
            atol=1e-6,
        )
    torch.testing.assert_close(remote.head.weight, local.head.weight)
    counters = attached["emb"].cache.counters
    if prefetch:
        assert counters.hits > 0  # rows prefetched and not pushed since
    assert counters.hits + counters.misses == sum(len(x.unique()) for x, _ in batches)


def test_the_cache_stays_bounded_on_a_table_far_larger_than_it():
    spec = TableSpec("huge", 10**9, 16)
    tables = _shards([spec], 2, RowOptimizerConfig("sgd", 0.1))
    emb = TableEmbedding("huge", tables, cache_rows=64)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        ids = torch.randint(0, 10**9, (40,), generator=g)
        emb(ids).sum().backward()
        assert emb.push() == len(ids.unique())
        assert len(emb.cache) <= 64 and emb.cache.values.shape == (64, 16)
    held = sum(t.held for t in tables.shards["huge"])
    assert held <= 20 * 40  # only rows ever touched exist, on the servers
    assert tables.traffic.rows_pushed == tables.traffic.rows_pulled  # each pushed row was pulled
    with pytest.raises(ValueError, match="do not fit a cache of 64"):
        emb(torch.arange(65))


def test_a_forward_without_backward_pushes_nothing_and_eval_records_nothing():
    tables = _shards([TableSpec("t", ROWS, DIM)], 1, RowOptimizerConfig("sgd", 0.1))
    emb = TableEmbedding("t", tables, cache_rows=32)
    emb(torch.tensor([1, 2, 2]))
    assert emb.push() == 0
    emb.eval()
    out = emb(torch.tensor([5]))
    assert not out.requires_grad and emb.gradients() is None
    torch.testing.assert_close(out[0], tables.pull("t", np.array([5]))[0])


def test_attach_refuses_what_a_table_cannot_take():
    tables = _shards([TableSpec("e", ROWS, DIM)], 1, RowOptimizerConfig("sgd", 0.1))
    with pytest.raises(ValueError, match="padding_idx"):
        attach_tables(nn.Sequential(nn.Embedding(ROWS, DIM, padding_idx=0, sparse=True)), tables)
    model = nn.Module()
    model.e = nn.Embedding(ROWS + 1, DIM, sparse=True)
    with pytest.raises(ValueError, match="its table is 300 x 8"):
        attach_tables(model, tables)
    dense = nn.Module()
    dense.e = nn.Embedding(ROWS, DIM)  # not sparse: stays a dense parameter
    assert attach_tables(dense, tables) == {} and table_specs(dense) == []


def test_a_cache_is_no_larger_than_its_table_and_one_too_large_is_one_line():
    """Issue 55's review: --cache-rows up to 2**31-1 was taken, and its cache allocated up
    front whole: a traceback at the join. A bounded table's cache holds at most its rows."""
    tables = _shards(
        [TableSpec("t", 100, 8), TableSpec("u", 0, 64)], 1, RowOptimizerConfig("sgd", 0.1)
    )
    assert TableEmbedding("t", tables, cache_rows=2**31 - 1).cache.values.shape == (100, 8)
    with pytest.raises(ConfigError, match=r"--cache-rows 2147483647: table 'u'.*give fewer rows"):
        TableEmbedding("u", tables, cache_rows=2**31 - 1)  # unbounded: 512 GiB up front
