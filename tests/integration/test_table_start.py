"""A sparse table starts from the module's own rows (issue 56, must 6): an ``nn.Embedding``
or ``nn.EmbeddingBag`` whose weight the user set (pretrained, or N(0, 0.02)) is served with
those rows, on one server or split over two shards, trains from them as torch trains the
same module locally, and a resume takes the checkpoint's rows, not a new module's. A
declared ``paramserver.sparse.Embedding`` keeps its seeded rows. On d1479b8 the servers
gave every table seeded N(0, 1) rows, with no warning."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from paramserver.sparse.rows import initial_rows, shard_of
from tests import sparse_models

ROWS, DIM, FIELDS, BATCH = 300, 8, 3, 16


def _users_model(seed: int = 0) -> nn.Module:
    """Clicky with rows set as a user sets them: small normal rows, and a pretrained bag."""
    torch.manual_seed(seed)
    model = sparse_models.Clicky(ROWS, DIM, FIELDS)
    with torch.no_grad():
        model.emb.weight.normal_(0.0, 0.02)
        model.bag.weight.copy_(torch.arange(ROWS * DIM, dtype=torch.float32).view(ROWS, DIM))
        model.bag.weight.mul_(1e-4)
    return model


def _table(servers: list[ps.ServerApp], name: str) -> torch.Tensor:
    ids = np.arange(ROWS)
    out = torch.full((ROWS, DIM), float("nan"))
    owner = shard_of(ids, len(servers))
    for i, server in enumerate(servers):
        mine = ids[owner == i]
        out[torch.from_numpy(mine)] = server.coordinator.tables.table(name).read(mine)
    return out


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = (torch.rand(steps, BATCH, FIELDS, generator=g) * ROWS).long()
    return [(ids[i], ids[i].sum(1) % 2) for i in range(steps)]


@pytest.mark.parametrize("shards", [1, 2])
def test_a_table_starts_from_the_modules_own_rows_and_trains_from_them(serve, shards):
    model = _users_model()
    local = copy.deepcopy(model)  # the same module, trained by torch alone
    servers = [
        serve(model, optimizer="sgd", lr=0.1, policy="sync", workers=1, shard=i, shards=shards)
        for i in range(shards)
    ]
    for name in ("emb", "bag"):
        assert torch.equal(_table(servers, name), getattr(local, name).weight.detach())
    if shards == 1:
        whole = servers[0].model_state_dict()
        assert torch.equal(whole["bag.weight"], local.bag.weight.detach())
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    with ps.Worker([s.address for s in servers], model) as worker:
        for x, y in _batches(4):
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))
            opt.zero_grad()
            F.cross_entropy(local(x), y).backward()
            opt.step()
    torch.testing.assert_close(_table(servers, "emb"), local.emb.weight.detach())
    torch.testing.assert_close(_table(servers, "bag"), local.bag.weight.detach())


def test_a_resume_takes_the_checkpoints_rows_not_a_new_modules(serve, tmp_path):
    settings = dict(optimizer="adam", lr=0.05, policy="async", workers=1)
    model = _users_model()
    server = serve(model, checkpoint_dir=str(tmp_path), **settings)
    with ps.Worker(server.address, model) as worker:
        for x, y in _batches(3):
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))
    trained = _table([server], "emb")
    server.stop()  # writes a last checkpoint
    other = _users_model(seed=5)  # other rows of its own: the checkpoint's win
    assert not torch.equal(other.emb.weight.detach(), trained)
    resumed = serve(other, checkpoint_dir=str(tmp_path), **settings)
    assert torch.equal(_table([resumed], "emb"), trained)


def test_a_declared_table_keeps_its_seeded_rows(serve):
    class Declared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = ps.sparse.Embedding(ROWS, DIM)
            self.head = nn.Linear(DIM, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x))  # type: ignore[no-any-return]

    server = serve(Declared(), optimizer="sgd", lr=0.1, workers=1)
    table = server.coordinator.tables.table("emb")
    assert table.held == 0  # created by their first push, as before
    expected = initial_rows(table.key, np.arange(ROWS), DIM)
    assert np.array_equal(table.read(np.arange(ROWS)).numpy(), expected)


def test_a_module_whose_rows_hold_nan_is_refused_in_one_line(serve):
    model = _users_model()
    with torch.no_grad():
        model.emb.weight[7, 2] = float("nan")  # as a weight left as torch.empty may
    with pytest.raises(ps.ConfigError, match="'emb'.*NaN or Inf"):
        serve(model, optimizer="sgd", lr=0.1, workers=1)
