"""The same-host control socket (server/doors/doorbell.py): who may use it, what it refuses
without changing anything, exactly once through it, and what happens when either side goes.
That its steps compute what gRPC's compute is in test_shm.py."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

import paramserver as ps
from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import records
from paramserver.transport import shm
from paramserver.transport.channels import ControlSocket
from tests.conftest import DEADLINE

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm here")


def _grads(worker: ps.Worker, value: float = 1.0) -> None:
    for p in worker.model.parameters():
        p.grad = torch.full_like(p, value)


def _socket(worker: ps.Worker) -> ControlSocket:
    control = worker.sessions[0].channel.control
    assert control is not None
    return control


def _push(worker: ps.Worker, iteration: int, **kw) -> pb.PushPullRequest:
    header = pb.PushHeader(
        worker_id=worker.worker_id,
        iteration=iteration,
        shm=True,
        incarnation=worker.incarnation,
        samples=1,
        **kw,
    )
    return pb.PushPullRequest(push=header)


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)  # another thread's progress; bounded by the deadline


def test_only_the_segments_worker_may_ring_and_refusals_change_nothing(serve):
    server = serve("mlp", workers=2, min_workers=1, policy="async")
    with ps.Worker(server.address) as worker, ps.Worker(server.address) as other:
        assert worker.control_active and other.control_active
        name = worker.sessions[0].reply.shm_control
        nonce = worker.sessions[0].channel.segment.nonce
        for wid, key in ((worker.worker_id, b"x" * shm.NONCE_BYTES), ("nobody", nonce)):
            with pytest.raises(grpc.RpcError) as err:
                ControlSocket(name, wid, key, 10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        mine = _socket(worker)
        with pytest.raises(grpc.RpcError) as err:  # the other worker's push on my connection
            mine.push_pull(_push(other, other.clock), 10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        records.send(mine.sock, records.Frame(b"\xff not a message"))
        with pytest.raises(grpc.RpcError) as err:
            records.raise_for(records.recv(mine.sock))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        bad = _push(worker, worker.clock, shm_slot=9)  # no such slot
        with pytest.raises(grpc.RpcError) as err:
            mine.push_pull(bad, 10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert server.status()["version"] == 0
        # the connection is still good after refusals: a real step goes through it
        _grads(worker)
        worker.step(samples=1)
        assert worker.control_active and server.status()["version"] == 1


def test_a_push_repeated_on_the_socket_is_acknowledged_not_applied_again(serve):
    server = serve("mlp", workers=1, policy="async")
    with ps.Worker(server.address) as worker:
        request = _push(worker, worker.clock, empty=False)
        first = _socket(worker).push_pull(request, 10).push
        again = _socket(worker).push_pull(request, 10).push
        assert not first.duplicate and again.duplicate
        assert server.status()["version"] == 1 and server.status()["duplicates"] == 1


def test_a_worker_goes_on_over_grpc_when_the_socket_goes(serve):
    server = serve("mlp", workers=1, policy="sync")
    with ps.Worker(server.address) as worker:
        _grads(worker)
        worker.step(samples=1)
        server.doorbell.close()  # the server's socket ends; gRPC stays up
        for _ in range(3):
            _grads(worker)
            worker.step(samples=1)
        assert worker.shm_active and not worker.control_active
        assert server.status()["version"] == 4 == worker.version


def test_the_server_lets_go_of_a_worker_whose_socket_closed(serve):
    server = serve("mlp", workers=1, policy="async")
    worker = ps.Worker(server.address)
    try:
        _wait(lambda: len(server.doorbell._conns) == 1, "the connection")
        _socket(worker).sock.close()  # as kill -9 would: no goodbye
        _wait(lambda: not server.doorbell._conns, "the server to drop the connection")
    finally:
        worker.close_quietly()
