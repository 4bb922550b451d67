"""Table rows through the shared segment: a row pull's values written into the worker's rows
part for pulls, a push's row gradients read from its slot's rows part. A worker that lies
about where its rows are, or truncates its segment, changes nothing and cannot crash the
server; a row pull that asks for shared memory without a segment is answered in the reply."""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import wire
from paramserver.transport import shm
from paramserver.transport.stub import Stub, connect

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm here")

ROWS, DIM, SLOTS, PART = 100, 4, 2, 4096


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(ROWS, DIM, sparse=True), nn.Flatten(), nn.Linear(DIM, 1))


def _unchanged(server) -> bool:
    """No row moved: the table still holds the module's own rows (``model()``'s)."""
    rows = server.coordinator.tables.table("0").read(np.arange(ROWS))
    return torch.equal(rows, model()[0].weight.detach())


class RowsPeer:
    """Raw gRPC calls and a named segment with rows parts of ``PART`` bytes."""

    def __init__(self, address: str, rows_bytes: int = PART):
        self.channel = connect(address, 10)
        self.stub = Stub(self.channel)
        first = self.stub.Join(pb.JoinRequest(name="rows-peer"), timeout=10)
        self.segment = shm.Segment(
            first.manifest.total_bytes, SLOTS, "float32", sealed=False, rows_bytes=rows_bytes
        )
        self.fd = os.open(self.segment.path, os.O_RDWR)
        self.reply = self.stub.Join(
            pb.JoinRequest(
                name="rows-peer",
                worker_id=first.worker_id,
                shm_name=self.segment.name,
                shm_nonce=self.segment.nonce,
                shm_slots=SLOTS,
                shm_rows_bytes=rows_bytes,
            ),
            timeout=10,
        )
        self.segment.unlink()
        assert self.reply.shm, "the server did not take the segment"
        self.worker_id, self.clock = self.reply.worker_id, self.reply.clock

    def push(self, rows: list[pb.RowGradients], shm_push: bool = True) -> pb.PushResponse:
        header = pb.PushHeader(
            worker_id=self.worker_id,
            iteration=self.clock,
            shm=shm_push,
            shm_slot=0,
            samples=1,
            incarnation=self.reply.incarnation,
            rows=rows,
        )
        if shm_push:
            return self.stub.PushPull(pb.PushPullRequest(push=header), timeout=10).push
        nbytes = self.reply.manifest.total_bytes  # the gradient streamed, the rows not
        header.total_bytes = nbytes
        return self.stub.Push(wire.encode_push(header, memoryview(bytes(nbytes)), 4096), timeout=10)

    def close(self) -> None:
        os.close(self.fd)
        self.segment.close()
        self.channel.close()


def _in_segment(ids: list[int], offset: int) -> pb.RowGradients:
    return pb.RowGradients(
        table="0", ids=np.array(ids, "<i8").tobytes(), shm=True, shm_offset=offset
    )


def test_rows_go_both_ways_through_the_segment(serve):
    server = serve(model(), optimizer="sgd", lr=1.0, policy="async", workers=1)
    peer = RowsPeer(server.address)
    try:
        grads = np.full((3, DIM), 0.5, np.float32)
        peer.segment.rows[1][:48] = np.frombuffer(grads.tobytes(), np.uint8)  # slot 0's part
        before = server.coordinator.tables.table("0").read(np.array([1, 2, 3]))
        peer.segment.slots[0][:] = 0.0
        peer.push([_in_segment([1, 2, 3], 0)])
        after = server.coordinator.tables.table("0").read(np.array([1, 2, 3]))
        torch.testing.assert_close(after, before - 0.5)
        reply = peer.stub.PullRows(
            pb.RowsRequest(
                worker_id=peer.worker_id,
                incarnation=peer.reply.incarnation,
                table="0",
                ids=np.array([1, 2, 3, 50], "<i8").tobytes(),
                shm=True,
                shm_stamp=77,
            ),
            timeout=10,
        )
        assert reply.shm and not reply.values and list(reply.shm_sizes) == [4 * DIM * 4]
        part = peer.segment.rows[0]
        assert int.from_bytes(part[:8].tobytes(), "little") == 77
        got = np.frombuffer(
            part[shm.ROWS_STAMP : shm.ROWS_STAMP + 4 * DIM * 4].tobytes(), np.float32
        )
        expected = server.coordinator.tables.table("0").read(np.array([1, 2, 3, 50]))
        np.testing.assert_array_equal(got.reshape(4, DIM), expected.numpy())
    finally:
        peer.close()


@pytest.mark.parametrize("offset", [-8, PART - 8, PART, 1 << 40])
def test_rows_placed_outside_the_slots_part_are_refused_and_change_nothing(serve, offset):
    server = serve(model(), optimizer="sgd", lr=1.0, policy="async", workers=1)
    peer = RowsPeer(server.address)
    try:
        with pytest.raises(grpc.RpcError) as err:
            peer.push([_in_segment([1, 2], offset)])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "rows part" in err.value.details()
        assert _unchanged(server) and server.status()["version"] == 0
    finally:
        peer.close()


def test_rows_in_the_segment_of_a_push_that_is_not_are_refused(serve):
    server = serve(model(), optimizer="sgd", lr=1.0, policy="async", workers=1)
    peer = RowsPeer(server.address)
    try:
        with pytest.raises(grpc.RpcError) as err:
            peer.push([_in_segment([1], 0)], shm_push=False)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "shared memory, but the push is not" in err.value.details()
        assert _unchanged(server)
    finally:
        peer.close()


def test_a_segment_truncated_before_its_rows_are_read_drops_its_worker(serve):
    server = serve(model(), optimizer="sgd", lr=1.0, policy="async", workers=2, min_workers=1)
    peer = RowsPeer(server.address)
    try:
        os.ftruncate(peer.fd, 0)
        with pytest.raises(grpc.RpcError) as err:
            peer.push([_in_segment([1], 0)])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "segment" in err.value.details() and peer.worker_id in err.value.details()
        assert peer.worker_id not in {w["worker_id"] for w in server.status()["workers"]}
        assert _unchanged(server)
    finally:
        peer.close()


def test_a_row_pull_asking_for_shared_memory_without_a_segment_is_answered_in_the_reply(serve):
    server = serve(model(), optimizer="sgd", lr=1.0, policy="async", workers=1)
    channel = connect(server.address, 10)
    try:
        stub = Stub(channel)
        joined = stub.Join(pb.JoinRequest(name="no-segment"), timeout=10)
        reply = stub.PullRows(
            pb.RowsRequest(
                worker_id=joined.worker_id,
                incarnation=joined.incarnation,
                table="0",
                ids=np.array([4], "<i8").tobytes(),
                shm=True,
            ),
            timeout=10,
        )
        assert not reply.shm and len(reply.values) == DIM * 4
    finally:
        channel.close()


def test_a_server_refuses_rows_parts_too_large_and_the_worker_streams(serve):
    server = serve(model(), optimizer="sgd", lr=1.0, policy="async", workers=1)
    with pytest.raises(AssertionError, match="did not take"):
        RowsPeer(server.address, rows_bytes=shm.MAX_ROWS_BYTES + 64)


def test_many_messages_over_one_part_are_refused_before_anything_is_read(serve, monkeypatch):
    """A table named again and again, each message over the whole part: the server would
    copy the part once a message; it refuses before reading any."""
    from paramserver.transport.attachments import Attachments

    reads = []
    real = Attachments.rows
    monkeypatch.setattr(Attachments, "rows", lambda self, *a: reads.append(a) or real(self, *a))
    server = serve(model(), optimizer="sgd", lr=1.0, policy="async", workers=1)
    peer = RowsPeer(server.address)
    try:
        whole = list(range(PART // (DIM * 4)))[:ROWS]
        for rows in (
            [_in_segment(whole, 0) for _ in range(16)],  # a table 16 times
            [_in_segment([1, 2], 0), pb.RowGradients(table="0", ids=b"\0" * 8, shm=True)],
        ):
            with pytest.raises(grpc.RpcError) as err:
                peer.push(rows)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "twice" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # ids that are not whole int64s
            peer.push([pb.RowGradients(table="0", ids=b"\0" * 12, shm=True)])
        assert "not whole" in err.value.details()
        assert reads == [] and _unchanged(server)
    finally:
        peer.close()


class _Stub:
    """PullRows that writes into the worker's part as a server would, then lets ``meddle``
    change it before the worker reads (a late writer of an earlier pull)."""

    def __init__(self, part: np.ndarray, meddle) -> None:
        self.part, self.meddle, self.calls = part, meddle, []

    def PullRows(self, request, timeout=None):  # noqa: N802 - the RPC's name
        self.calls.append(request.shm)
        values = np.arange(DIM, dtype=np.float32).tobytes()
        if not request.shm:
            return pb.RowsResponse(values=values)
        self.part[shm.ROWS_STAMP : shm.ROWS_STAMP + len(values)] = np.frombuffer(values, np.uint8)
        self.part[:8] = np.frombuffer(request.shm_stamp.to_bytes(8, "little"), np.uint8)
        self.meddle(self.part)
        return pb.RowsResponse(shm=True, shm_sizes=[len(values)])


@pytest.mark.parametrize("late", [False, True])
def test_values_stamped_by_another_pull_are_not_used(late):
    from paramserver.transport.shm_channel import ShmChannel

    segment = shm.Segment(1024, SLOTS, sealed=False, rows_bytes=PART)
    try:
        channel = ShmChannel(None, segment)  # type: ignore[arg-type]

        def meddle(part: np.ndarray) -> None:
            if late:  # another pull's writer stamps over this one's values
                part[:8] = np.frombuffer((12345).to_bytes(8, "little"), np.uint8)

        stub = _Stub(segment.rows[0], meddle)
        reply = channel.pull_rows(stub, pb.RowsRequest(table="0"), 10)  # type: ignore[arg-type]
        assert np.frombuffer(reply.values, np.float32).tolist() == list(range(DIM))
        assert stub.calls == ([True, False] if late else [True])  # pulled again in the reply
    finally:
        segment.close()


def test_a_pushs_rows_go_straight_into_the_segment_and_stay_for_a_retry():
    """A push's row gradients are written into its slot's rows part when its header is made:
    the messages carry offsets, no values; making them again (nothing does: a retry resends
    the header) writes the same bytes at the same offsets. Rows that do not all fit travel in
    the messages, all of them."""
    from paramserver.codec.rows import RowGradients
    from paramserver.transport.shm_channel import ShmChannel

    segment = shm.Segment(1024, SLOTS, sealed=False, rows_bytes=PART)
    try:
        channel = ShmChannel(None, segment)  # type: ignore[arg-type]
        a = torch.full((2, DIM), 1.0)
        b = torch.arange(3 * DIM, dtype=torch.float32).reshape(DIM, 3).t()  # not contiguous
        parts = [RowGradients("a", np.arange(2), a), RowGradients("b", np.array([7, 8, 9]), b)]
        first = channel.row_messages(parts, 1)
        again = channel.row_messages(parts, 1)
        assert [(m.table, m.shm, m.shm_offset, m.values) for m in first] == [
            ("a", True, 0, b""),
            ("b", True, 64, b""),
        ]
        assert np.frombuffer(first[1].ids, "<i8").tolist() == [7, 8, 9]
        assert first == again
        part = segment.rows[2]
        assert part[:32].tobytes() == a.numpy().tobytes()
        assert part[64:112].tobytes() == b.contiguous().numpy().tobytes()
        assert not segment.rows[1][:112].any()  # slot 0's part: untouched
        big = [
            parts[0],
            RowGradients("b", np.arange(PART // (4 * DIM)), torch.ones(PART // 16, DIM)),
        ]
        inline = channel.row_messages(big, 0)  # b does not fit: neither moves
        assert [m.shm for m in inline] == [False, False]
        assert inline[0].values == a.numpy().tobytes()
        assert not segment.rows[1][:64].any()
    finally:
        segment.close()
