"""Malformed requests get a clear gRPC status and leave the server's state untouched.

A property-based test sends over a thousand of them, each breaking one rule of the wire
contract, to a real server; then the weights and version must be byte-identical and a
correct push and pull must still work.
"""

from __future__ import annotations

import math
from typing import Any

import grpc
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import paramserver as ps
from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression, wire
from paramserver.config import MAX_PUSH_EVERY
from paramserver.server.doors import steps
from paramserver.transport.stub import Stub
from tests.conftest import tiny_model

CLEAR = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
}
PUSH_FAULTS = [
    "header_bytes",
    "short_stream",
    "long_stream",
    "odd_bytes",
    "dtype",
    "non_finite",
    "unknown_worker",
    "ahead",
    "past",
    "negative_iteration",
    "incarnation",
    "shard",
    "no_header",
    "empty_stream",
    "two_headers",
    "empty_with_data",
    # the rows of a sparse table that ride with the push
    "rows_unknown_table",
    "rows_ids_bytes",
    "rows_values_bytes",
    "rows_out_of_range",
    "rows_duplicate",
    "rows_non_finite",
    "rows_table_twice",
    "rows_with_empty",
    # a declared unbounded table with a lifecycle: nothing counted, admitted or evicted
    "rows_unbounded_width",
    "rows_unbounded_with_a_bad_table",
    # rows that follow the header as row chunks (PushHeader.row_chunks)
    "row_chunks_short",
    "row_chunks_duplicate",
    "row_chunks_and_header_rows",
    "row_chunks_unannounced",
    "row_chunks_out_of_range",
    # the server-handed batches a push names (PushHeader.batches)
    "batches_too_many",
    "batches_negative",
    "batches_twice",
    # --compress int8: a payload of another size than its scales and values, a scale per
    # another block, a negative or non-finite scale
    "int8_bytes",
    "int8_block",
    "int8_scale",
    # --compress fp16/bf16: an exact tail (the buffers, whole) beyond the model, or bytes
    # that are not 16-bit values and that many whole elements
    "bf16_exact",
    # the parameters without a gradient (PushHeader.idle): an odd count, a range empty,
    # unsorted, overlapping or past the parameters
    "idle",
]
OTHER_FAULTS = [
    "pull_unknown_worker",
    "pull_incarnation",
    "pull_ahead",
    "heartbeat_unknown",
    "heartbeat_incarnation",
    "join_negative_samples",
    "rewind",
    "pull_rows_unknown_table",
    "pull_rows_ids_bytes",
    "pull_rows_out_of_range",
    "pull_rows_incarnation",
    "pull_rows_unknown_worker",
    # a pull of several tables at once (RowsRequest.more): nothing is read or created
    "pull_rows_more_unknown_table",
    "pull_rows_table_twice",
    "pull_rows_more_out_of_range",
    # a pull whose reply would pass the message limit (made small here): refused before work
    "pull_rows_reply_too_large",
    # PushPull: neither part, or a pull alone that does not go through shared memory
    "pushpull_empty",
    "pushpull_pull_not_shm",
    # weights asked for in int8 (pulls with --compress int8 come in bf16)
    "pull_int8",
]
ROWS, DIM = 100, 4  # the probed model's sparse table "emb"
REPLY_LIMIT = 4096  # the bytes a row pull's reply may carry, in this test


class WithTable(nn.Module):
    """The tiny MLP beside a sparse table, so that the server holds one."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = tiny_model()
        self.emb = nn.Embedding(ROWS, DIM, sparse=True)
        self.emb2 = nn.Embedding(ROWS, DIM, sparse=True)
        life = ps.sparse.Lifecycle(admit_after=2, capacity=8)
        self.users = ps.sparse.Embedding(None, DIM, lifecycle=life)  # any int64 id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def _rows(ids: list[int], values: np.ndarray | None = None, table: str = "emb") -> pb.RowGradients:
    if values is None:
        values = np.full((len(ids), DIM), 0.5, np.float32)
    return pb.RowGradients(
        table=table, ids=np.array(ids, "<i8").tobytes(), values=values.astype("<f4").tobytes()
    )


class Target:
    """A real server with one joined worker whose valid requests the faults start from."""

    CLOCK = 5  # the prober's clock once set up: pushes 0..2 are too old to be retries

    def __init__(self, server):
        self.server = server
        self.channel = grpc.insecure_channel(server.address)
        self.stub = Stub(self.channel)
        reply = self.stub.Join(pb.JoinRequest(name="prober"), timeout=10)
        self.worker_id, self.incarnation = reply.worker_id, reply.incarnation
        self.nbytes = reply.manifest.total_bytes
        for iteration in range(self.CLOCK):
            self.push(iteration)

    def push(self, iteration: int) -> pb.PushResponse:
        h = pb.PushHeader(
            worker_id=self.worker_id, iteration=iteration, samples=1, incarnation=self.incarnation
        )
        payload = memoryview(_payload(self.nbytes))
        return self.stub.Push(wire.encode_push(h, payload, 4096), timeout=10)

    def state(self) -> tuple[Any, ...]:
        store, tables = self.server.coordinator.store, self.server.coordinator.tables
        rows = tables.table("emb").read(np.arange(ROWS)).numpy().tobytes()
        users = tables.table("users")
        counts = (users.tally.state(), users.sketch.counts.tobytes())
        return store.snapshot().tobytes(), store.version, rows, tables.held, counts


def _payload(n: int, fill: float = 0.01) -> bytes:
    return np.full(n // 4, fill, np.float32).tobytes() + b"\0" * (n % 4)


def _push(t: Target, fault: str, data: st.DataObject) -> list[pb.PushChunk]:
    h = pb.PushHeader(
        worker_id=t.worker_id,
        iteration=t.CLOCK,
        total_bytes=t.nbytes,
        samples=1,
        incarnation=t.incarnation,
    )
    body = _payload(t.nbytes)
    row_chunks: list[pb.RowGradients] = []
    if fault.startswith("row_chunks"):  # two chunks of the table, then the faults' changes
        row_chunks = [_rows([1, 2]), _rows([3])]
        h.row_chunks = len(row_chunks)
    if fault == "header_bytes":
        h.total_bytes = data.draw(st.integers(0, 1 << 40).filter(lambda n: n != t.nbytes))
    elif fault == "short_stream":
        body = body[: data.draw(st.integers(0, t.nbytes - 1))]
    elif fault == "long_stream":
        body += b"\0" * data.draw(st.integers(1, 9000))
    elif fault == "odd_bytes":
        h.total_bytes = t.nbytes + data.draw(st.integers(1, 3))
        body = _payload(h.total_bytes)
    elif fault == "dtype":
        h.dtype = data.draw(
            st.text(min_size=1, max_size=12).filter(lambda s: s not in compression.BY_DTYPE)
        )
    elif fault == "non_finite":
        values = np.frombuffer(body, np.float32).copy()
        bad = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        values[data.draw(st.integers(0, len(values) - 1))] = bad
        body = values.tobytes()
    elif fault == "idle":
        n = t.server.coordinator.store.n_params
        h.idle.extend(
            data.draw(
                st.one_of(
                    st.lists(st.integers(0, n), min_size=1, max_size=9).filter(
                        lambda v: len(v) % 2 == 1
                    ),
                    st.integers(0, n).map(lambda a: [a, a]),  # empty
                    st.integers(1, n).map(lambda a: [a, a - 1]),  # backwards
                    st.integers(n + 1, 1 << 62).map(lambda b: [0, b]),  # past the parameters
                    st.integers(-(1 << 62), -1).map(lambda a: [a, 1]),
                    st.integers(2, n).map(lambda b: [0, b, b - 1, b]),  # overlapping
                )
            )
        )
    elif fault == "unknown_worker":
        h.worker_id = data.draw(st.text(max_size=20).filter(lambda s: s != t.worker_id))
    elif fault == "ahead":
        h.iteration = data.draw(st.integers(t.CLOCK + 1, 1 << 62))
    elif fault == "past":  # async lets 2 pushes be in flight: 3 and 4 are retries, 0..2 not
        h.iteration = data.draw(st.integers(0, t.CLOCK - 3))
    elif fault == "negative_iteration":
        h.iteration = data.draw(st.integers(-(1 << 62), -1))
    elif fault == "incarnation":
        h.incarnation = data.draw(
            st.text(min_size=1, max_size=16).filter(lambda s: s != t.incarnation)
        )
    elif fault == "shard":
        h.shard = data.draw(st.integers(1, 1 << 30))
    elif fault == "empty_with_data":
        h.empty, h.total_bytes = True, 0
    elif fault == "batches_too_many":
        h.batches.extend(range(data.draw(st.integers(MAX_PUSH_EVERY + 1, 5000))))
    elif fault == "batches_negative":
        h.batches.extend([0, data.draw(st.integers(-(1 << 62), -1))])
    elif fault == "batches_twice":
        b = data.draw(st.integers(0, 1 << 40))
        h.batches.extend([b, b])
    elif fault == "rows_unknown_table":
        h.rows.append(_rows([1], table=data.draw(st.text(max_size=8).filter(lambda s: s != "emb"))))
    elif fault == "rows_ids_bytes":
        h.rows.append(_rows([1, 2]))
        h.rows[0].ids += b"\0" * data.draw(st.integers(1, 7))
    elif fault == "rows_values_bytes":
        h.rows.append(_rows([1, 2]))
        cut = data.draw(st.integers(1, len(h.rows[0].values)))
        h.rows[0].values = h.rows[0].values[:-cut]
    elif fault == "rows_out_of_range":
        bad = data.draw(st.one_of(st.integers(-(1 << 62), -1), st.integers(ROWS, 1 << 62)))
        h.rows.append(_rows([3, bad]))
    elif fault == "rows_duplicate":
        i = data.draw(st.integers(0, ROWS - 1))
        h.rows.append(_rows([i, (i + 1) % ROWS, i]))
    elif fault == "rows_non_finite":
        values = np.full((2, DIM), 0.5, np.float32)
        values[data.draw(st.integers(0, 1)), data.draw(st.integers(0, DIM - 1))] = data.draw(
            st.sampled_from([math.nan, math.inf, -math.inf])
        )
        h.rows.append(_rows([4, 5], values))
    elif fault == "rows_table_twice":
        h.rows.extend([_rows([1]), _rows([2])])
    elif fault == "row_chunks_short":  # announces more chunks than follow the header
        h.row_chunks += data.draw(st.integers(1, 1 << 20))
    elif fault == "row_chunks_duplicate":  # an id in two chunks of the table
        row_chunks.append(_rows([data.draw(st.sampled_from([1, 2, 3]))]))
        h.row_chunks = len(row_chunks)
    elif fault == "row_chunks_and_header_rows":
        h.rows.append(_rows([7]))
    elif fault == "row_chunks_unannounced":
        h.row_chunks = data.draw(st.integers(0, len(row_chunks) - 1))
    elif fault == "row_chunks_out_of_range":
        bad = data.draw(st.one_of(st.integers(-(1 << 62), -1), st.integers(ROWS, 1 << 62)))
        row_chunks.append(_rows([bad]))
        h.row_chunks = len(row_chunks)
    elif fault == "rows_unbounded_width":
        ids = data.draw(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=1, max_size=4))
        h.rows.append(_rows(sorted(set(ids)), table="users"))
        h.rows[0].values = h.rows[0].values[: -data.draw(st.integers(1, 4 * DIM))]
    elif fault == "rows_unbounded_with_a_bad_table":  # good rows of users, then a bad table
        ids = data.draw(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=1, max_size=4))
        h.rows.append(_rows(sorted(set(ids)), table="users"))
        h.rows.append(_rows([data.draw(st.integers(ROWS, 1 << 62))]))
    elif fault == "rows_with_empty":
        h.empty, h.total_bytes = True, 0
        h.rows.append(_rows([1]))
        body = b""
    elif fault.startswith("int8"):
        body = _int8(t, fault, h, data)
    elif fault == "bf16_exact":
        body = _bf16(t, h, data)
    chunk = data.draw(st.sampled_from([1024, 4096, 1 << 16, 1 << 20]))
    chunks = [pb.PushChunk(data=body[i : i + chunk]) for i in range(0, len(body), chunk)]
    if fault == "empty_with_data":
        chunks = chunks[:1]
    if fault == "no_header":
        return chunks
    if fault == "empty_stream":
        return []
    if fault == "two_headers":
        return [pb.PushChunk(header=h), pb.PushChunk(header=h), *chunks]
    return [pb.PushChunk(header=h), *(pb.PushChunk(rows=r) for r in row_chunks), *chunks]


def _int8(t: Target, fault: str, h: pb.PushHeader, data: st.DataObject) -> bytes:
    """An int8 push of the gradient 0.01, broken as ``fault`` says; ``h`` made to match."""
    codec = compression.Int8(t.nbytes // 4)
    body = np.frombuffer(codec.encode(torch.full((t.nbytes // 4,), 0.01)), np.uint8).copy()
    h.dtype, h.scale_block, h.total_bytes = "int8", codec.block, codec.nbytes
    if fault == "int8_bytes":  # as the header says, but not the model's scales and values
        change = data.draw(st.integers(-body.nbytes, 5000).filter(lambda n: n != 0))
        body = np.resize(body, body.nbytes + change)
        h.total_bytes = body.nbytes
    elif fault == "int8_block":
        h.scale_block = data.draw(st.integers(-(1 << 62), 1 << 62).filter(lambda n: n != 1024))
    elif fault == "int8_scale":
        bad = data.draw(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -1e-30]))
        scales = body[: 4 * codec.blocks].view(np.float32)
        scales[data.draw(st.integers(0, codec.blocks - 1))] = bad
    return body.tobytes()


def _bf16(t: Target, h: pb.PushHeader, data: st.DataObject) -> bytes:
    """A bf16 push whose header's ``exact`` (the elements sent whole in float32 after the
    16-bit ones) is outside the model, or whose bytes, as many as the header says, are not
    those of its ``exact``."""
    numel = t.nbytes // 4
    h.dtype = "bfloat16"
    h.exact = data.draw(st.one_of(st.integers(0, numel), st.integers(-(1 << 62), 1 << 62)))
    honest = 2 * (numel - h.exact) + 4 * h.exact if 0 <= h.exact <= numel else -1
    h.total_bytes = data.draw(st.integers(0, 4 * numel + 64).filter(lambda n: n != honest))
    return np.full(h.total_bytes // 2, 0x3C23, np.uint16).tobytes() + b"\0" * (h.total_bytes % 2)


def _other(t: Target, fault: str, data: st.DataObject) -> None:
    wrong = data.draw(
        st.text(min_size=1, max_size=16).filter(lambda s: s not in (t.worker_id, t.incarnation))
    )
    if fault == "pull_unknown_worker":
        list(t.stub.Pull(pb.PullRequest(worker_id=wrong, iteration=0), timeout=10))
    elif fault == "pull_incarnation":
        list(t.stub.Pull(pb.PullRequest(worker_id=t.worker_id, incarnation=wrong), timeout=10))
    elif fault == "pull_ahead":
        it = data.draw(st.integers(t.CLOCK + 3, 1 << 62))
        list(t.stub.Pull(pb.PullRequest(worker_id=t.worker_id, iteration=it), timeout=10))
    elif fault == "heartbeat_unknown":
        t.stub.Heartbeat(pb.HeartbeatRequest(worker_id=wrong), timeout=10)
    elif fault == "pushpull_empty":
        t.stub.PushPull(pb.PushPullRequest(), timeout=10)
    elif fault == "pushpull_pull_not_shm":
        request = pb.PullRequest(
            worker_id=t.worker_id, iteration=t.CLOCK, incarnation=t.incarnation
        )
        t.stub.PushPull(pb.PushPullRequest(pull=request), timeout=10)
    elif fault == "pull_int8":
        request = pb.PullRequest(
            worker_id=t.worker_id, iteration=t.CLOCK, incarnation=t.incarnation, dtype="int8"
        )
        list(t.stub.Pull(request, timeout=10))
    elif fault == "heartbeat_incarnation":
        t.stub.Heartbeat(pb.HeartbeatRequest(worker_id=t.worker_id, incarnation=wrong), timeout=10)
    elif fault == "rewind":  # this server keeps no cuts: any rewind, even well formed, is refused
        incarnation = data.draw(st.sampled_from([t.incarnation, wrong]))
        t.stub.Rewind(
            pb.RewindRequest(
                round=data.draw(st.integers(-(1 << 62), 1 << 62)),
                incarnation=incarnation,
                worker_id=t.worker_id,
            ),
            timeout=10,
        )
    elif fault.startswith("pull_rows"):
        request = pb.RowsRequest(
            worker_id=t.worker_id,
            incarnation=t.incarnation,
            table="emb",
            ids=np.array([1, 2], "<i8").tobytes(),
        )
        if fault == "pull_rows_unknown_table":
            request.table = wrong
        elif fault == "pull_rows_ids_bytes":
            request.ids += b"\0" * data.draw(st.integers(1, 7))
        elif fault == "pull_rows_out_of_range":
            bad = data.draw(st.one_of(st.integers(-(1 << 62), -1), st.integers(ROWS, 1 << 62)))
            request.ids = np.array([1, bad], "<i8").tobytes()
        elif fault == "pull_rows_more_unknown_table":
            request.more.add(table=wrong.replace("emb", "x"), ids=request.ids)
        elif fault == "pull_rows_table_twice":
            request.more.add(table=data.draw(st.sampled_from(["emb2", "emb"])), ids=request.ids)
            request.more.add(table=request.more[0].table, ids=np.array([3], "<i8").tobytes())
        elif fault == "pull_rows_more_out_of_range":
            bad = data.draw(st.one_of(st.integers(-(1 << 62), -1), st.integers(ROWS, 1 << 62)))
            request.more.add(table="emb2", ids=np.array([1, bad], "<i8").tobytes())
        elif fault == "pull_rows_reply_too_large":
            many = data.draw(st.integers(REPLY_LIMIT // (DIM * 4) + 1, 4 * REPLY_LIMIT))
            request.ids = np.ones(many, "<i8").tobytes()
        elif fault == "pull_rows_incarnation":
            request.incarnation = wrong
        else:
            request.worker_id = wrong
        t.stub.PullRows(request, timeout=10)
    elif fault == "join_negative_samples":
        t.stub.Join(
            pb.JoinRequest(name="x", train_samples=data.draw(st.integers(-(1 << 62), -1))),
            timeout=10,
        )


def test_a_thousand_malformed_requests_change_nothing(serve, monkeypatch):
    monkeypatch.setattr(steps, "ROWS_REPLY_LIMIT", REPLY_LIMIT)
    server = serve(WithTable(), optimizer="sgd", lr=0.1, policy="async", lease_seconds=600)
    target = Target(server)
    before = target.state()
    seen: dict[str, int] = {}

    @settings(
        max_examples=1200,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(fault=st.sampled_from(PUSH_FAULTS + OTHER_FAULTS), data=st.data())
    def probe(fault: str, data: st.DataObject) -> None:
        try:
            if fault in PUSH_FAULTS:
                target.stub.Push(iter(_push(target, fault, data)), timeout=10)
            else:
                _other(target, fault, data)
        except grpc.RpcError as err:
            assert err.code() in CLEAR, (fault, err.code(), err.details())
            assert err.details(), fault
            seen[fault] = seen.get(fault, 0) + 1
        else:
            raise AssertionError(f"{fault} was accepted")

    probe()
    assert sum(seen.values()) >= 1000
    assert set(seen) == set(PUSH_FAULTS + OTHER_FAULTS)
    assert target.state() == before, "a malformed request changed the weights, version or rows"

    # The server still serves a correct push and pull.
    clock = target.CLOCK
    reply = target.push(clock)
    assert (reply.version, reply.clock, reply.duplicate) == (clock + 1, clock + 1, False)
    request = pb.PullRequest(
        worker_id=target.worker_id, iteration=clock + 1, incarnation=target.incarnation
    )
    header, weights = wire.decode_pull(target.stub.Pull(request, timeout=10), None, target.nbytes)
    expected = np.frombuffer(before[0], np.float32) - np.float32(0.1) * np.float32(0.01)
    assert header.version == clock + 1
    np.testing.assert_allclose(weights, expected, rtol=1e-6, atol=1e-9)
    # and a correct row pull: the table's seeded rows, untouched by the faults
    rows = target.stub.PullRows(
        pb.RowsRequest(
            worker_id=target.worker_id,
            table="emb",
            incarnation=target.incarnation,
            ids=np.array([1, 2], "<i8").tobytes(),
        ),
        timeout=10,
    )
    initial = np.frombuffer(before[2], np.float32).reshape(ROWS, DIM)[[1, 2]]
    np.testing.assert_array_equal(np.frombuffer(rows.values, "<f4").reshape(2, DIM), initial)
    target.channel.close()
