"""Sparse tables through real servers: a model whose embeddings have
``sparse=True`` trains with only the touched rows on the wire, and ends as torch trains the
same model locally, over one server or two shards, through each step path."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from paramserver.codec import rows as sparse_wire
from paramserver.server.disk import checkpoint
from paramserver.sparse import tablestate
from paramserver.sparse.embedding import TableEmbedding
from paramserver.sparse.rows import shard_of
from paramserver.training import clicks
from paramserver.training.evaluation import evaluate
from tests import sparse_models
from tests.conftest import DEADLINE, WorkerThread, launch_clicks
from tests.sparse_models import dlrm_sparse

ROWS, DIM, FIELDS, BATCH = 500, 8, 3, 16


def Clicky() -> nn.Module:  # noqa: N802 - stands for the class
    return sparse_models.Clicky(ROWS, DIM, FIELDS, bag_mode="sum")


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = (torch.rand(steps, BATCH, FIELDS, generator=g) ** 2 * ROWS).long()
    return [(ids[i], ids[i].sum(1) % 2) for i in range(steps)]


def _table(servers: list[ps.ServerApp], name: str) -> torch.Tensor:
    """The whole table ``name``, read from the shards that hold its rows."""
    ids = np.arange(ROWS)
    out = torch.empty(ROWS, DIM)
    owner = shard_of(ids, len(servers))
    for i, server in enumerate(servers):
        mine = ids[owner == i]
        out[torch.from_numpy(mine)] = server.coordinator.tables.table(name).read(mine)
    return out


def _local_twin(model: nn.Module, servers: list[ps.ServerApp]) -> nn.Module:
    """A local copy of ``model`` whose tables start from the servers' seeded rows."""
    local = Clicky()
    local.load_state_dict(model.state_dict())
    with torch.no_grad():
        local.emb.weight.copy_(_table(servers, "emb"))
        local.bag.weight.copy_(_table(servers, "bag"))
    return local


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("shm", [True, False])
def test_a_model_with_tables_trains_as_torch_trains_it_locally(serve, shards, shm):
    _trains_as_torch(serve, shards, shm)


@pytest.mark.parametrize("shm", [True, False])
def test_rows_too_many_for_one_message_follow_the_header_in_chunks(serve, shm, monkeypatch):
    """A push's rows above ``ROWS_IN_HEADER`` (8 MiB; 200 bytes here) go as row chunks
    after the header, a table's rows over several; training is unchanged."""
    monkeypatch.setattr(sparse_wire, "ROWS_IN_HEADER", 200)
    split = sparse_wire.split_rows
    chunks: list[int] = []

    def spy(header, limit=None):
        sent, rows = split(header, limit)
        assert not rows or (not sent.rows and sent.row_chunks == len(rows))
        assert all(r.ByteSize() <= 200 for r in rows)
        chunks.append(len(rows))
        return sent, rows

    monkeypatch.setattr(sparse_wire, "split_rows", spy)
    _trains_as_torch(serve, 2, shm, wire="grpc")  # gRPC streams' chunks (the data port's
    # frames carry a push's rows whole, up to records.MAX_PAYLOAD: see below)
    assert chunks and min(chunks) > 2  # every push went as chunks, its tables in pieces


@pytest.mark.parametrize("shards", [1, 2])
def test_next_rows_fetched_while_this_batch_computes_train_as_torch(serve, shards):
    """Issue 44: ``prefetch(next ids, wait=False)`` before a batch computes fetches the next
    batch's rows meanwhile, under async; a row this step pushes is fetched again, so one
    worker still trains exactly as torch, and the rows prefetched are the forward passes'
    cache hits."""
    worker = _trains_as_torch(serve, shards, True, policy="async", ahead=True)
    counters = worker.tables.counters
    assert counters.hits > 0 and counters.fetched > 0


def _trains_as_torch(
    serve, shards: int, shm: bool, wire: str = "auto", policy: str = "sync", ahead: bool = False
) -> ps.Worker:
    torch.manual_seed(0)
    model = Clicky()
    servers = [
        serve(model, optimizer="sgd", lr=0.1, policy=policy, workers=1, shard=i, shards=shards)
        for i in range(shards)
    ]
    local = _local_twin(model, servers)
    opt = torch.optim.SGD(local.parameters(), lr=0.1)

    worker = ps.Worker([s.address for s in servers], model, shm=shm, wire=wire)
    try:
        assert isinstance(model.emb, TableEmbedding) and isinstance(model.bag, TableEmbedding)
        assert [n for n, _ in model.named_parameters()] == ["head.weight", "head.bias"]
        batches = _batches(10)
        for i, (x, y) in enumerate(batches):
            if ahead and i + 1 < len(batches):
                nxt = batches[i + 1][0]
                worker.prefetch({"emb": nxt, "bag": nxt}, wait=False)
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))
            opt.zero_grad()
            F.cross_entropy(local(x), y).backward()
            opt.step()
    finally:
        worker.close()
    torch.testing.assert_close(_table(servers, "emb"), local.emb.weight.detach())
    torch.testing.assert_close(_table(servers, "bag"), local.bag.weight.detach())
    torch.testing.assert_close(model.head.weight, local.head.weight)
    touched = len(torch.cat([x.flatten() for x, _ in _batches(10)]).unique())
    held = sum(s.coordinator.tables.held for s in servers)
    assert held == 2 * ROWS  # each table's own rows, held from the start
    assert touched < ROWS  # and only the rows touched went over the wire (rows_pushed)
    assert sum(s.status()["rows_pushed"] for s in servers) <= 2 * 10 * BATCH * FIELDS
    return worker


@pytest.mark.parametrize("prefetch", ["", "now", "soon"])
def test_two_sync_workers_are_one_large_batch(serve, prefetch):
    """Two workers, each half of every batch, under sync: the tables end as one local model
    trained on the whole batches (mean of the halves' mean losses). With ``prefetch`` each
    fetches its next half's rows before its step ("now"), or in the background while this
    half computes ("soon", ``wait=False``), while the other's push of the same rows may
    still be on its way (issue 27: the round changed row 7 after it was prefetched): the
    rows are fetched again after the round's pull, so the training stays exact."""
    torch.manual_seed(1)
    model = Clicky()
    server = serve(model, optimizer="sgd", lr=0.1, policy="sync", workers=2)
    local = _local_twin(model, [server])
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    batches = _batches(6)

    def run(half: int) -> None:
        replica = Clicky()
        replica.load_state_dict(model.state_dict())
        part = slice(half * BATCH // 2, (half + 1) * BATCH // 2)
        with ps.Worker(server.address, replica) as worker:
            # the rows each forward pass computed with, to hold against the local model's
            replica.emb.register_forward_hook(lambda m, i, out: used[half].append(out.detach()))
            for i, (x, y) in enumerate(batches):
                ahead = batches[i + 1][0][part] if i + 1 < len(batches) else None
                if prefetch == "soon" and ahead is not None:
                    worker.prefetch({"emb": ahead, "bag": ahead}, wait=False)
                F.cross_entropy(replica(x[part]), y[part]).backward()
                if prefetch == "now" and ahead is not None:
                    worker.prefetch({"emb": ahead, "bag": ahead})
                worker.step(samples=BATCH // 2)

    used: list[list[torch.Tensor]] = [[], []]
    threads = [WorkerThread(lambda h=h: run(h), name=f"w{h}") for h in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.result(timeout=60)
    for i, (x, y) in enumerate(batches):
        for half, p in enumerate((slice(0, 8), slice(8, 16))):  # rows exact, round by round
            torch.testing.assert_close(used[half][i], local.emb(x[p]).detach(), rtol=0, atol=1e-6)
        opt.zero_grad()
        halves = [F.cross_entropy(local(x[p]), y[p]) for p in (slice(0, 8), slice(8, 16))]
        (sum(halves) / 2).backward()
        opt.step()
    torch.testing.assert_close(_table([server], "emb"), local.emb.weight.detach())
    torch.testing.assert_close(_table([server], "bag"), local.bag.weight.detach())


def test_a_worker_whose_embeddings_are_not_the_servers_tables_is_refused(serve):
    """The servers' manifest decides which embeddings are tables: a worker's dense one of
    the same name and size becomes the table; a sparse one the servers do not hold, or one
    of another size, is refused."""
    server = serve(Clicky(), optimizer="sgd", workers=3, min_workers=1)
    dense = Clicky()
    dense.emb = nn.Embedding(ROWS, DIM)  # sparse=False here: made the servers' table
    with ps.Worker(server.address, dense) as worker:
        assert set(worker.tables.modules) == {"emb", "bag"}
        extra = Clicky()
        extra.more = nn.Embedding(ROWS, DIM, sparse=True)  # no such table on the servers
        with pytest.raises(ps.ConfigError, match="not the servers' tables"):
            ps.Worker(server.address, extra)
        smaller = Clicky()
        smaller.emb = nn.Embedding(ROWS - 1, DIM, sparse=True)
        with pytest.raises(ps.ConfigError, match="its table is"):
            ps.Worker(server.address, smaller)


def test_launch_trains_a_model_with_tables_and_checkpoints_them(tmp_path):
    """``launch`` with a model whose embeddings are sparse tables: the workers push rows,
    the evaluation reads the servers' current rows, and the checkpoint holds the whole
    tables, so it loads strictly into the model and scores what launch reported."""
    summary, out = launch_clicks(tmp_path, "tests.sparse_models:dlrm_sparse")
    assert summary["test_auc"] > 0.7
    state = checkpoint.load(tmp_path / os.path.basename(summary["run_dir"]) / "checkpoint.pt")
    model = dlrm_sparse()
    model.load_state_dict(state["model_state_dict"], strict=True)
    _, _, test_x, test_y = clicks.make()
    assert evaluate(model, test_x, test_y).auc == pytest.approx(summary["test_auc"], abs=1e-6)


@pytest.mark.parametrize("path", ["streamed", "data-port", "control-socket"])
def test_rows_of_a_push_whose_reply_is_lost_are_applied_once(serve, path, monkeypatch):
    """The rows ride with the dense push: a retried push is a duplicate for both."""
    from paramserver.transport.channels import ControlSocket
    from paramserver.transport.stub import Stub, connect
    from paramserver.transport.tcp import TcpChannel
    from tests.integration.test_exactly_once import DropPushReplies, DropSocketReplies

    torch.manual_seed(2)
    start = Clicky()
    shm = path == "control-socket"
    wire = "auto" if path == "data-port" else "grpc"

    def train(transport=None) -> tuple[ps.ServerApp, torch.Tensor]:
        model = Clicky()
        model.load_state_dict(start.state_dict())
        server = serve(model, optimizer="sgd", lr=0.1, policy="delay-1", workers=1)
        with ps.Worker(server.address, model, shm=shm, wire=wire, transport=transport) as w:
            assert w.data_port_active is (path == "data-port")
            for x, y in _batches(12):
                F.cross_entropy(model(x), y).backward()
                w.step(samples=len(x))
        return server, _table([server], "emb")

    _, expected = train()
    dropper = DropPushReplies(every=3) if path == "streamed" else DropSocketReplies(every=3)
    if path == "control-socket":
        monkeypatch.setattr(ControlSocket, "push_pull", dropper.wrap(ControlSocket.push_pull))
    if path == "data-port":
        monkeypatch.setattr(TcpChannel, "_step", dropper.wrap(TcpChannel._step))
    lossy, got = train(lambda a: Stub(grpc.intercept_channel(connect(a, DEADLINE), dropper)))
    assert dropper.dropped >= 4
    assert lossy.status()["duplicates"] == dropper.dropped
    assert torch.equal(got, expected)


@pytest.mark.parametrize("rows", ["", "adam"])
def test_a_server_checkpoint_holds_the_tables_and_resumes_them(serve, tmp_path, rows):
    """Under --optimizer adam's sparse-adam, and lazy adam (--table-optimizer adam)."""
    torch.manual_seed(3)
    model = Clicky()
    start = Clicky()
    start.load_state_dict(model.state_dict())
    settings = dict(optimizer="adam", lr=0.05, policy="async", workers=1, table_optimizer=rows)
    server = serve(model, checkpoint_dir=str(tmp_path), **settings)
    with ps.Worker(server.address, model) as worker:
        for x, y in _batches(5):
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))
    trained = _table([server], "emb")
    held = server.coordinator.tables.held
    server.stop()  # writes a last checkpoint
    resumed = serve(start, checkpoint_dir=str(tmp_path), **settings)
    assert resumed.coordinator.tables.held == held
    torch.testing.assert_close(_table([resumed], "emb"), trained, rtol=0, atol=0)
    saved = tablestate.state_dict(resumed.coordinator.tables.table("emb"))
    # the moments came back, the table's steps (sparse-adam's count), and lazy adam's
    # each row's steps
    assert saved["steps"] == 5 and len(saved["state"]) == (3 if rows else 2)
    assert saved["state"][0].abs().sum() > 0
    if rows:
        assert int(saved["state"][2].max()) <= 5


@pytest.mark.parametrize("path", ["control-socket", "data-port"])
def test_a_push_larger_than_a_control_frame_goes_over_grpc_and_keeps_the_socket(serve, path):
    from paramserver.codec import records
    from paramserver.transport import shm as shm_module

    if path == "control-socket" and not shm_module.available():
        pytest.skip("no writable /dev/shm here")
    wide = 4096  # 300 rows x 4096 float32 = 4.9 MB of row gradients, above one frame
    model = nn.Sequential(nn.EmbeddingBag(1000, wide, mode="sum", sparse=True), nn.Linear(wide, 2))
    server = serve(model, optimizer="sgd", lr=0.1, policy="async", workers=1)
    with ps.Worker(server.address, model, shm=path == "control-socket") as worker:

        def active() -> bool:
            return worker.control_active if path == "control-socket" else worker.data_port_active

        assert active()
        for step in range(3):
            ids = torch.arange(300) + 300 * step
            assert 300 * wide * 4 > records.MAX_PAYLOAD
            F.cross_entropy(model(ids.view(1, -1)), torch.tensor([step % 2])).backward()
            worker.step(samples=1)
        assert active()  # the socket stayed in use for the small requests
    assert server.coordinator.tables.held == 1000  # the bag's own rows
    assert server.status()["rows_pushed"] == 900
    assert server.status()["version"] == 3


@pytest.mark.parametrize("shm", [False, True])
def test_a_push_of_rows_larger_than_a_grpc_message_is_applied(serve, shm):
    """17,000 rows x 1024 float32 = 70 MB of row gradients, above gRPC's 64 MiB message
    limit: they follow the header in chunks, and every row is applied."""
    wide, n = 1024, 17_000
    model = nn.Sequential(nn.EmbeddingBag(n, wide, mode="sum", sparse=True), nn.Linear(wide, 2))
    server = serve(model, optimizer="sgd", lr=0.1, policy="async", workers=1)
    with ps.Worker(server.address, model, shm=shm) as worker:
        assert n * wide * 4 > 64 << 20
        F.cross_entropy(model(torch.arange(n).view(1, -1)), torch.tensor([1])).backward()
        worker.step(samples=1)
    assert server.coordinator.tables.held == n
    assert server.status()["rows_pushed"] == n


def test_a_table_trains_with_the_row_optimizer_table_optimizer_names(serve):
    model = nn.Sequential(nn.EmbeddingBag(500, 8, mode="sum", sparse=True), nn.Linear(8, 2))
    server = serve(
        model,
        optimizer="adam",
        lr=0.01,
        policy="async",
        workers=1,
        table_optimizer="0=rowwise-adagrad:0.05",
    )
    table = server.coordinator.tables.table("0")
    assert (
        table.optimizer.config.name == "rowwise-adagrad"
        and not server.coordinator.tables.scheduled["0"]
    )
    with ps.Worker(server.address, model) as worker:
        for step in range(3):
            F.cross_entropy(
                model(torch.arange(10).view(1, -1) + step), torch.tensor([1])
            ).backward()
            worker.step(samples=1)
    assert table.held == 500 and [s.shape[1] for s in table.state] == [1]
    (spec,) = server._servicer.steps.manifest().tables  # what a join tells the workers
    assert (spec.optimizer, spec.lr) == ("rowwise-adagrad", 0.05)
    fresh = nn.Sequential(nn.EmbeddingBag(500, 8, mode="sum", sparse=True), nn.Linear(8, 2))
    with pytest.raises(ps.ConfigError, match="'nope', which the model does not hold"):
        ps.serve(fresh, table_optimizer="nope=sgd", port=0)
    with pytest.raises(ps.ConfigError, match="the model holds no sparse table"):
        ps.serve(nn.Linear(8, 2), table_optimizer="adam", port=0)


@pytest.mark.parametrize("shm", [True, False])
def test_rows_travel_in_the_shared_segment_on_the_same_host(serve, shm, monkeypatch):
    """With shared memory, a row pull's values come through the worker's segment and a
    push's row gradients go through it (the messages carry ids); training is unchanged."""
    from paramserver.transport import shm as shm_module
    from paramserver.transport.attachments import Attachments

    if shm and not shm_module.available():
        pytest.skip("no writable /dev/shm here")
    used = {"put_rows": 0, "rows": 0}
    for name in used:
        real = getattr(Attachments, name)

        def counted(self, *args, _real=real, _name=name):
            used[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(Attachments, name, counted)
    _trains_as_torch(serve, 2, shm)
    if shm:
        assert used["put_rows"] > 0 and used["rows"] > 0
    else:
        assert used == {"put_rows": 0, "rows": 0}


def test_a_live_sharded_runs_model_is_read_from_every_shard(serve):
    """``ps.model_state_dict(every shard, model)``: the dense part from each shard's range and
    the tables read whole, row by row; it loads strictly, and a shard alone refuses."""
    torch.manual_seed(0)
    model = Clicky()
    servers = [
        serve(model, optimizer="sgd", lr=0.1, policy="sync", workers=1, shard=i, shards=2)
        for i in range(2)
    ]
    worker = ps.Worker([s.address for s in servers], model)
    try:
        for x, y in _batches(4):
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))
        state = ps.model_state_dict([s.address for s in servers], Clicky())
    finally:
        worker.close()
    fresh = Clicky()
    fresh.load_state_dict(state, strict=True)
    torch.testing.assert_close(fresh.emb.weight.detach(), _table(servers, "emb"))
    torch.testing.assert_close(fresh.bag.weight.detach(), _table(servers, "bag"))
    torch.testing.assert_close(fresh.head.weight, model.head.weight)
    with pytest.raises(ps.ConfigError, match="ps.model_state_dict"):
        servers[0].model_state_dict()
