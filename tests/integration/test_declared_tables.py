"""One model definition, both ways: a model with declared tables (``ps.sparse.Embedding``
and ``EmbeddingBag``) trains on its own and through real servers (1 and 2 shards) to the
same rows and weights; the servers use the tables' declared initialiser, optimizer and
lifecycle, and allocate nothing for the rows declared."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from paramserver.server.disk import checkpoint
from paramserver.server.metrics import StatusCollector
from paramserver.sparse import Embedding, EmbeddingBag, Lifecycle
from paramserver.sparse.declared import name_tables
from paramserver.sparse.embedding import TableEmbedding
from paramserver.sparse.rows import shard_of
from tests.conftest import cli, launch_clicks
from tests.sparse_models import Huge, dlrm_declared

ITEMS = 10**12  # 16 TB of float32 rows declared
USERS = np.array([-(2**62), -7, -1, 0, 3, 2**40, 2**62 + 5, 11, 12, 13], np.int64)


class Recommender(nn.Module):
    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.users = Embedding(
            None,  # unbounded: any int64 id
            4,
            optimizer="rowwise-adagrad",
            lr=0.05,
            lifecycle=Lifecycle(capacity=capacity, evict="lru"),
        )
        self.items = EmbeddingBag(ITEMS, 4, mode="mean", init="normal:0.1", optimizer="sgd", lr=0.2)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.users(x[:, 0]), self.items(x[:, 1:])], 1))


def batches(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(3)
    out = []
    for _ in range(n):
        users = rng.choice(USERS, 6)
        items = rng.integers(0, 40, (6, 3)) * (ITEMS // 40)
        x = torch.from_numpy(np.concatenate([users[:, None], items], 1))
        out.append((x, torch.from_numpy(rng.integers(0, 2, 6))))
    return out


def rows_of(servers: list[ps.ServerApp], table: str, ids: np.ndarray) -> torch.Tensor:
    out = torch.empty(len(ids), 4)
    owner = shard_of(ids, len(servers))
    for i, server in enumerate(servers):
        mine = owner == i
        out[torch.from_numpy(mine)] = server.coordinator.tables.table(table).read(ids[mine])
    return out


@pytest.mark.parametrize("shards", [1, 2])
def test_one_model_definition_trains_the_same_on_its_own_and_in_a_cluster(serve, shards):
    capacity = 6 if shards == 1 else 0  # a capacity is per shard: compared on one
    torch.manual_seed(0)
    model, alone = Recommender(capacity), Recommender(capacity)
    alone.load_state_dict(model.state_dict())
    name_tables(alone)
    servers = [
        serve(model, optimizer="sgd", lr=0.1, policy="sync", workers=1, shard=i, shards=shards)
        for i in range(shards)
    ]
    first = servers[0].coordinator.tables
    assert first.table("users").optimizer.config.name == "rowwise-adagrad"
    assert not first.scheduled["users"] and first.table("users").spec.rows == 0
    assert first.table("items").init.b == 0.1
    opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    with ps.Worker([s.address for s in servers], model) as worker:
        assert isinstance(model.users, TableEmbedding) and isinstance(model.items, TableEmbedding)
        for x, y in batches():
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))
            opt.zero_grad()
            F.cross_entropy(alone(x), y).backward()
            opt.step()
    items = np.unique(torch.cat([x[:, 1:].flatten() for x, _ in batches()]).numpy())
    torch.testing.assert_close(rows_of(servers, "users", USERS), alone.users.local.pull(USERS))
    torch.testing.assert_close(rows_of(servers, "items", items), alone.items.local.pull(items))
    torch.testing.assert_close(model.head.weight, alone.head.weight)
    for server in servers:  # nothing in proportion to the 10**12 rows declared
        assert server.coordinator.tables.table("items").nbytes() < 4 << 20
    status = servers[0].status()
    if capacity:
        assert first.table("users").held <= capacity
        assert status["table_evicted"]["users"] > 0
        assert status["table_evicted"]["users"] == alone.users.local.tally.evicted
        scraped = {
            (s.name, s.labels.get("table")): s.value
            for m in StatusCollector(servers[0].coordinator.status).collect()
            for s in m.samples
        }
        evicted = status["table_evicted"]["users"]
        assert scraped[("paramserver_table_evicted_total", "users")] == evicted
        assert (
            scraped[("paramserver_table_admitted_total", "users")]
            == (status["table_admitted"]["users"])
        )
    assert status["table_rows"]["items"] == int(np.sum(shard_of(items, shards) == 0))


class Tied(nn.Module):
    """One table under two paths (a query tower and an item tower sharing it)."""

    def __init__(self) -> None:
        super().__init__()
        self.items = Embedding(100, 4, optimizer="sgd", lr=0.5)
        self.query = self.items
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.items(x[:, 0]) * self.query(x[:, 1]))


def test_a_table_under_two_paths_is_one_table_on_the_servers(serve):
    torch.manual_seed(0)
    model = Tied()
    server = serve(model, optimizer="sgd", lr=0.1, policy="sync", workers=1)
    with ps.Worker(server.address, model) as worker:
        assert model.items is model.query and isinstance(model.query, TableEmbedding)
        model(torch.tensor([[1, 2], [3, 2]])).sum().backward()
        worker.step(samples=2)
    assert server.coordinator.tables.table("items").held == 3  # both paths' rows
    assert [s.name for s in server.coordinator.tables.specs] == ["items"]


def test_launch_trains_declared_unbounded_tables_and_says_what_its_checkpoint_leaves_out(
    tmp_path,
):
    """``launch`` of a model whose tables are declared unbounded: the workers train them,
    the evaluation reads the servers' rows, and checkpoint.pt (which cannot hold an
    unbounded table whole) says so in the log and still loads strictly into the model.
    With no --checkpoint-dir the rows are not lost: the servers checkpoint them into the
    run folder, as the log says before the run starts (checkpoint.pt held only the dense
    part, and its warning named a --checkpoint-dir that was never set)."""
    summary, out = launch_clicks(tmp_path, "tests.sparse_models:dlrm_declared")
    assert summary["test_auc"] > 0.6
    assert "table 'tables.0' is not written whole into checkpoint.pt (it is unbounded)" in (
        out.stderr
    )
    run = tmp_path / os.path.basename(summary["run_dir"])
    state = checkpoint.load(run / "checkpoint.pt")
    assert not [k for k in state["model_state_dict"] if k.startswith("tables.")]
    dlrm_declared().load_state_dict(state["model_state_dict"], strict=True)
    said = out.stderr.index(f"the servers checkpoint their rows into {run / 'servers'}")
    assert said < out.stderr.index("workers started")  # before the run starts
    assert f"its rows: in the servers' checkpoints in {run / 'servers'}" in out.stderr
    kept = checkpoint.load(run / "servers" / checkpoint.server_file(0, 1))
    assert kept["row_chain"] and kept["version"] == state["version"]


def test_a_servers_state_dict_leaves_out_a_table_too_large_to_hold_whole(serve, caplog):
    """A declared 10^12-row table: ``ServerApp.model_state_dict`` tried to allocate it
    whole (64 TB); it leaves it out and says so, as ``ps.model_state_dict`` does."""

    server = serve(Huge(), policy="async")
    state = server.model_state_dict()
    assert sorted(state) == ["l.bias", "l.weight"]
    assert "table 't' is not written whole into the state dict (it is 59604.6 GiB" in caplog.text


def test_export_refuses_a_table_too_large_to_hold_before_allocating_it(serve, tmp_path):
    """``paramserver export`` (not --snapshot) of a run with a declared 10^12-row table
    tried to allocate it whole; it is refused in one line naming --snapshot."""
    server = serve(Huge(), policy="async", checkpoint_dir=str(tmp_path / "run"))
    server.stop()
    out = cli(
        *("export", str(tmp_path / "run"), "--model", "tests.sparse_models:Huge"),
        *("--out", str(tmp_path / "whole.pt")),
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "Table 't' is 59604.6 GiB whole" in out.stderr and "--snapshot" in out.stderr
    assert not (tmp_path / "whole.pt").exists()
