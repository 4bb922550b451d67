"""Sparse tables: rows fetched ahead (``Worker.prefetch`` in a user's loop, the
daemon's background prefetch), the row figures in the servers' status and metrics, and a
row pull that meets a restarted server."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver.config import WorkerConfig
from paramserver.server.metrics import StatusCollector
from paramserver.sparse import remote
from paramserver.sparse.remote import RemoteTables
from paramserver.training import clicks, trainer
from paramserver.transport import shm as shm_module
from tests.integration.test_tables import BATCH, DIM, ROWS, Clicky, _batches, _local_twin, _table


def _distinct(x: torch.Tensor) -> int:
    return len(np.unique(x.numpy()))


def test_rows_named_ahead_are_fetched_before_the_forward_pass_and_counted(serve):
    """A user's loop names the next batch's ids after each step: every forward pass but the
    first finds all its rows cached, the training is still exactly torch's, and the servers'
    status and metrics count the rows."""
    torch.manual_seed(4)
    model = Clicky()
    server = serve(model, optimizer="sgd", lr=0.1, policy="sync", workers=1)
    local = _local_twin(model, [server])
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    batches = _batches(8)
    with ps.Worker(server.address, model) as worker:
        for i, (x, y) in enumerate(batches):
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))
            if i + 1 < len(batches):
                ahead = batches[i + 1][0]
                worker.prefetch({"emb": ahead, "bag": ahead})
            opt.zero_grad()
            F.cross_entropy(local(x), y).backward()
            opt.step()
        counters = worker.tables.counters
        status = server.status()
        scraped = {m.name: m for m in StatusCollector(server.coordinator.status).collect()}
    torch.testing.assert_close(_table([server], "emb"), local.emb.weight.detach())
    torch.testing.assert_close(_table([server], "bag"), local.bag.weight.detach())
    assert counters.misses == 2 * _distinct(batches[0][0])  # two tables, the first batch
    assert counters.hits == 2 * sum(_distinct(x) for x, _ in batches[1:])
    touched = _distinct(torch.cat([x.flatten() for x, _ in batches]))
    assert status["rows_held"] == 2 * ROWS  # the modules' own rows, held from the start
    assert status["rows_pushed"] == 2 * sum(_distinct(x) for x, _ in batches)
    assert status["rows_pulled"] >= 2 * touched
    # the last push said what the caches had done before it (the last step's counts)
    (w,) = status["workers"]
    assert w["row_cache_hits"] == counters.hits
    assert w["row_cache_misses"] == counters.misses
    assert scraped["paramserver_rows_held"].samples[0].value == 2 * ROWS
    by_table = {s.labels["table"]: s.value for s in scraped["paramserver_table_rows"].samples}
    assert len(by_table) == 2 and sum(by_table.values()) == 2 * ROWS
    assert status["table_rows"] == by_table
    cache = {s.labels["result"]: s.value for s in scraped["paramserver_worker_row_cache"].samples}
    assert cache == {"hit": counters.hits, "miss": counters.misses}
    assert len(batches[0][0]) == BATCH


def test_a_prefetch_of_several_tables_is_one_request_a_shard(serve, monkeypatch):
    """``worker.prefetch`` asks each shard once for the rows of every table it lacks, in
    requests of at most ``PULL_BYTES`` of values (5 rows here), and the forward pass then
    finds them cached, with the servers' values."""
    torch.manual_seed(5)
    model = Clicky()
    servers = [
        serve(model, optimizer="sgd", lr=0.1, policy="sync", workers=1, shard=i, shards=2)
        for i in range(2)
    ]
    monkeypatch.setattr(remote, "PULL_BYTES", 5 * DIM * 4)
    requests: list[list[tuple[str, int]]] = []
    pull_part = RemoteTables._pull_part

    def count(self, s, pieces, lows):
        requests.append([(spec.name, len(ids)) for spec, ids in pieces])
        return pull_part(self, s, pieces, lows)

    monkeypatch.setattr(RemoteTables, "_pull_part", count)
    x, y = _batches(1)[0]
    with ps.Worker([s.address for s in servers], model) as worker:
        worker.prefetch({"emb": x[:2].tolist()})  # some rows first (ids as a list)
        assert requests and all(t == "emb" for r in requests for t, _ in r)
        requests.clear()
        worker.prefetch({"emb": x, "bag": x})  # the rest of both tables
        lacking = 2 * _distinct(x) - _distinct(x[:2])
        assert sum(n for r in requests for _, n in r) == lacking
        assert all(sum(n for _, n in r) <= 5 for r in requests)
        assert any(len({t for t, _ in r}) == 2 for r in requests)  # both tables, one request
        assert all(len({t for t, _ in r}) == len(r) for r in requests)
        requests.clear()
        for name in ("emb", "bag"):
            table = worker.tables.modules[name]
            ids = np.unique(x.numpy())
            cached = table.cache.values[table.cache.index.find(ids)]
            torch.testing.assert_close(cached, _table(servers, name)[torch.from_numpy(ids)])
        F.cross_entropy(model(x), y).backward()
        assert requests == []  # the forward pass found every row
        assert worker.tables.counters.misses == 0
        worker.step(samples=len(x))


def test_a_row_pull_that_meets_a_restarted_server_joins_it_again(serve, tmp_path):
    """The server restarts from its checkpoint between two steps: the next forward pass's
    row pull finds a new incarnation and joins it again; that step's work is dropped (as a
    push that meets a restarted server is), and the next steps train on."""
    torch.manual_seed(5)
    model = Clicky()
    start = Clicky()
    start.load_state_dict(model.state_dict())
    server = serve(
        model, optimizer="sgd", lr=0.1, policy="async", workers=1, checkpoint_dir=str(tmp_path)
    )
    port = int(server.address.rsplit(":", 1)[1])
    batches = _batches(6)
    with ps.Worker(server.address, model, server_timeout=60) as worker:
        for x, y in batches[:3]:
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))
        server.stop()  # writes a last checkpoint, at version 3
        resumed = serve(
            start,
            optimizer="sgd",
            lr=0.1,
            policy="async",
            workers=1,
            checkpoint_dir=str(tmp_path),
            port=port,
        )
        assert resumed.status()["version"] == 3
        for x, y in batches[3:]:
            F.cross_entropy(model(x), y).backward()  # its rows: pulled from the new server
            worker.step(samples=len(x))
        assert worker.rejoins == 1
    status = resumed.status()
    assert status["version"] == 5 and status["pushes_applied"] == 5
    assert status["rows_pushed"] == 2 * sum(_distinct(x) for x, _ in batches[4:])


@pytest.mark.parametrize("overlap,shm", [("on", "on"), ("on", "off"), ("off", "on")])
def test_the_daemon_fetches_a_batchs_rows_before_its_forward_pass(serve, overlap, shm, monkeypatch):
    """Before each forward pass the daemon fetches the batch's rows that its caches lack, of
    every table in one request (one shard here), not one a table. With overlap (async) most
    came in the background while the previous batch computed: named by the prefetching
    steps' early pull (shared memory), or over gRPC by the pull before, which names the
    next step's batches too (issue 44); those the last push touched are fetched again,
    since that push updated them."""
    if shm == "on" and not shm_module.available():
        pytest.skip("prefetching steps need a writable /dev/shm")
    requests: list[int] = []  # tables a row pull asked for, one entry a request
    pull_part = RemoteTables._pull_part

    def count(self, s, pieces, lows):
        requests.append(len(pieces))
        return pull_part(self, s, pieces, lows)

    monkeypatch.setattr(RemoteTables, "_pull_part", count)
    server = serve(
        "tests.sparse_models:dlrm_sparse",
        optimizer="adam",
        lr=0.01,
        policy="async",
        workers=1,
        dataset="clicks",
        batch_size=256,
        epochs=1,
    )
    summary = trainer.run(
        WorkerConfig(server.address, device="cpu", overlap=overlap, shm=shm, max_steps=30)
    )
    assert summary.steps == 30
    assert summary.row_cache_hits > 0
    assert summary.row_cache_misses == 0  # every row was there before the forward pass
    if overlap == "off":
        assert requests == [clicks.FIELDS] * 30
    else:  # the background's request, and one for the rows the last push took out (the
        # first step's, and over gRPC the second's, fetched before their forward pass)
        assert sum(requests) > 30 * clicks.FIELDS and len(requests) <= 2 * 30 + 2
        assert len(requests) > 30
    assert server.status()["rows_pushed"] > 0


@pytest.mark.parametrize("policy", ["async", "delay-1"])
def test_a_daemon_naming_its_next_batches_runs_them_all_once(serve, policy, tmp_path):
    """Over gRPC with overlap, each pull names the next step's batches too and takes them
    for the worker (issue 44): the run still ends with every batch applied once, and the
    worker's batch log lists each once."""
    server = serve(
        "tests.sparse_models:dlrm_sparse",
        optimizer="adam",
        lr=0.01,
        policy=policy,
        workers=1,
        dataset="clicks",
        batch_size=8192,
        epochs=1,
    )
    log = tmp_path / "batches.log"
    cfg = WorkerConfig(server.address, device="cpu", overlap="on", shm="off", batch_log=str(log))
    summary = trainer.run(cfg)
    status = server.status()
    assert status["batches_done"] == status["batches_total"] == clicks.TRAIN // 8192
    logged = sorted(int(b) for line in log.read_text().split("\n") for b in line.split())
    assert logged == list(range(status["batches_total"]))
    assert summary.row_cache_misses == 0 and summary.row_cache_hits > 0


def test_the_servers_model_state_dict_holds_the_tables_whole(serve, tmp_path, monkeypatch):
    """``ServerApp.model_state_dict()`` loads strictly into the model, tables whole, and so
    does a single server's checkpoint with its row files (``export.assemble``; the file
    alone holds the dense part, its tables are in the row folders beside it); a shard of
    several says it holds a part. Row pulls larger than a request's share (here 3 rows) go
    as several requests."""
    from paramserver.server.disk import checkpoint, export

    monkeypatch.setattr(remote, "PULL_BYTES", 3 * 8 * 4)  # 3 rows of DIM 8 float32
    torch.manual_seed(6)
    model = Clicky()
    server = serve(
        model, optimizer="adam", lr=0.05, policy="async", workers=1, checkpoint_dir=str(tmp_path)
    )
    with ps.Worker(server.address, model) as worker:
        for x, y in _batches(4):
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))
    state = server.model_state_dict()
    fresh = Clicky()
    fresh.load_state_dict(state, strict=True)
    torch.testing.assert_close(fresh.emb.weight.detach(), _table([server], "emb"), rtol=0, atol=0)
    torch.testing.assert_close(fresh.bag.weight.detach(), _table([server], "bag"), rtol=0, atol=0)
    torch.testing.assert_close(fresh.head.weight, model.head.weight)
    server.stop()  # writes a last checkpoint
    path = tmp_path / checkpoint.SERVER_FILE
    saved = checkpoint.with_rows(checkpoint.load(path), path)
    assert not {"emb.weight", "bag.weight"} & set(saved["model_state_dict"])
    again = Clicky()
    again.load_state_dict(export.assemble(Clicky(), [saved]), strict=True)
    torch.testing.assert_close(again.emb.weight, fresh.emb.weight, rtol=0, atol=0)
    shard = serve(Clicky(), optimizer="sgd", workers=1, shard=0, shards=2)
    with pytest.raises(ps.ConfigError, match="holds a part"):
        shard.model_state_dict()


def test_table_rows_makes_a_large_dense_embedding_a_table(serve):
    """``--table-rows N``: a dense embedding of at least N rows is a table too (the worker
    learns it from the manifest) and trains as torch's SGD trains it locally; a smaller
    one stays in the flat buffer."""
    from torch import nn

    def build() -> nn.Module:
        torch.manual_seed(7)
        return nn.ModuleDict(
            {"big": nn.Embedding(300, 4), "small": nn.Embedding(20, 4), "head": nn.Linear(8, 2)}
        )

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = build()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.m["head"](torch.cat([self.m["big"](x), self.m["small"](x % 20)], 1))

    server = serve(Two(), optimizer="sgd", lr=0.1, policy="sync", workers=1, table_rows=100)
    assert [t.name for t in server.coordinator.tables.specs] == ["m.big"]
    model, local = Two(), Two()  # dense, as built: the worker makes "m.big" a table at join
    with torch.no_grad():
        rows = server.coordinator.tables.table("m.big").read(np.arange(300))
        local.m["big"].weight.copy_(rows)
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with ps.Worker(server.address, model) as worker:
        assert set(worker.tables.modules) == {"m.big"}
        for _ in range(5):
            x = torch.randint(0, 300, (16,), generator=g)
            y = x % 2
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=16)
            opt.zero_grad()
            F.cross_entropy(local(x), y).backward()
            opt.step()
    state = server.model_state_dict()
    torch.testing.assert_close(state["m.big.weight"], local.m["big"].weight.detach())
    torch.testing.assert_close(state["m.small.weight"], local.m["small"].weight.detach())


@pytest.mark.parametrize("policy", ["async", "delay-1"])
def test_a_prefetching_daemon_runs_to_the_end_of_the_servers_batches(serve, policy):
    """A prefetching worker pulls iteration t+1 before it pushes t: at the end of the run its
    last pull must not wait for the end, which waits for its own last batch. It gets no
    batch, pushes an empty step and finishes."""
    from tests.conftest import DEADLINE, WorkerThread

    if not shm_module.available():
        pytest.skip("prefetching steps need a writable /dev/shm")
    server = serve("mlp", policy=policy, workers=1, dataset="synthetic", batch_size=256, epochs=1)
    run = WorkerThread(
        lambda: trainer.run(WorkerConfig(server.address, device="cpu", overlap="on"))
    )
    run.start()
    summary = run.result(timeout=DEADLINE)
    status = server.status()
    assert status["batches_done"] == status["batches_total"] == 16
    assert summary.samples == 16 * 256


def test_the_tables_follow_the_servers_learning_rate_schedule(serve):
    """With --lr-schedule cosine the rows are stepped at each step's rate, as the dense
    part is; the manifest names the tables' optimizer and base rate."""
    from paramserver.config import OptimizerConfig

    torch.manual_seed(8)
    model = Clicky()
    steps = 5
    server = serve(
        model,
        optimizer="sgd",
        lr=0.2,
        lr_schedule="cosine",
        lr_total_steps=steps,
        policy="async",
        workers=1,
    )
    (spec,) = [t for t in server._servicer.steps.manifest().tables if t.name == "emb"]
    assert (spec.optimizer, spec.lr) == ("sgd", pytest.approx(0.2))
    local = _local_twin(model, [server])
    opt = torch.optim.SGD(local.parameters(), lr=0.2)
    schedule = OptimizerConfig("sgd", 0.2, schedule="cosine", total_steps=steps)
    with ps.Worker(server.address, model) as worker:
        for i, (x, y) in enumerate(_batches(steps)):
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))
            for group in opt.param_groups:
                group["lr"] = schedule.lr_at(i)
            opt.zero_grad()
            F.cross_entropy(local(x), y).backward()
            opt.step()
    torch.testing.assert_close(_table([server], "emb"), local.emb.weight.detach())
    torch.testing.assert_close(_table([server], "bag"), local.bag.weight.detach())


def test_skip_nonfinite_skips_a_push_whose_rows_hold_nan(serve):
    """With --skip-nonfinite a push whose row gradients hold NaN is skipped and counted, as
    a dense one is: neither its rows nor its dense gradient are applied; the next push is."""
    torch.manual_seed(9)
    model = Clicky()
    server = serve(model, optimizer="sgd", lr=0.1, policy="async", workers=1, skip_nonfinite=True)
    (x, y), (x2, y2) = _batches(2)
    with ps.Worker(server.address, model) as worker:
        before = _table([server], "emb")
        head = server.model_state_dict()["head.weight"]
        F.cross_entropy(model(x), y).backward()
        _, rows = model.emb._used[0]
        rows.grad[0, 0] = float("nan")  # one row of one table
        worker.step(samples=len(x))
        status = server.status()
        assert status["pushes_skipped"] == 1 and status["rows_pushed"] == 0
        torch.testing.assert_close(_table([server], "emb"), before, rtol=0, atol=0)
        torch.testing.assert_close(server.model_state_dict()["head.weight"], head, rtol=0, atol=0)
        F.cross_entropy(model(x2), y2).backward()
        worker.step(samples=len(x2))
    assert server.status()["rows_pushed"] > 0
    assert not torch.equal(_table([server], "emb"), before)
