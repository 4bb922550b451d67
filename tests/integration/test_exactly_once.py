"""A push whose reply is lost is retried; the server acknowledges the retry without applying
it again. And 32 concurrent workers under load: the count of applied updates is exact."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from paramserver.training import data
from paramserver.transport import shm as shm_module
from paramserver.transport.channels import ControlSocket
from paramserver.transport.stub import Stub, connect
from paramserver.transport.tcp import TcpChannel
from tests.conftest import DEADLINE, WorkerThread, replica, tiny_model


class _Lost(grpc.RpcError):
    """What a client sees when the reply of a call that reached the server is lost."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "reply dropped by the test"


class DropPushReplies(grpc.StreamUnaryClientInterceptor, grpc.UnaryUnaryClientInterceptor):
    """Lets every ``every``-th push (a streamed Push, or a PushPull when the payloads are in
    shared memory) reach the server and be answered, then loses the reply. A PushPull
    without a push (a pull through shared memory) is not a push: it goes through."""

    def __init__(self, every: int):
        self.every = every
        self.pushes = 0
        self.dropped = 0

    def _maybe_drop(self, outcome):  # type: ignore[no-untyped-def]
        self.pushes += 1
        if self.pushes % self.every == 1:
            outcome.result()  # the server has applied it ...
            self.dropped += 1
            raise _Lost()  # ... but the worker never hears back
        return outcome

    def intercept_stream_unary(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        return self._maybe_drop(continuation(details, request_iterator))

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        outcome = continuation(details, request)
        if not details.method.endswith("/PushPull") or not request.HasField("push"):
            return outcome
        return self._maybe_drop(outcome)


class DropSocketReplies(DropPushReplies):
    """The same losses on the same-host control socket or the data port: the server
    answered, the worker hears nothing (the session retries on the same socket)."""

    def wrap(self, push_pull):  # type: ignore[no-untyped-def]
        def lossy(socket, request, *args):  # type: ignore[no-untyped-def]
            reply = push_pull(socket, request, *args)
            if request.HasField("push"):
                self._maybe_drop(Answered(reply))
            return reply

        return lossy


class Answered:
    def __init__(self, value):  # type: ignore[no-untyped-def]
        self.value = value

    def result(self):  # type: ignore[no-untyped-def]
        return self.value


def _train(
    address: str, model: nn.Module, steps: int, shm: str, transport=None
) -> dict[str, torch.Tensor]:
    ds = data.synthetic(train=256, test=16)
    kw = {
        "shm": shm not in ("streamed", "data-port"),
        "shm_control": shm == "control-socket",
        "wire": "auto" if shm == "data-port" else "grpc",
    }
    with ps.Worker(address, model, transport=transport, **kw) as w:
        assert w.shm_active is (kw["shm"] and shm_module.available())
        assert w.control_active is (kw["shm_control"] and shm_module.available())
        assert w.data_port_active is (shm == "data-port")
        for step in range(steps):
            idx = data.batch_indices(len(ds.train_x), 0, 16, step)
            F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx]).backward()
            w.step(samples=len(idx))
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("shm", ["streamed", "data-port", "shared-memory", "control-socket"])
@pytest.mark.parametrize("policy", ["sync", "delay-1"])
def test_a_push_whose_reply_is_lost_is_applied_once(serve, policy, shm, monkeypatch):
    steps = 20
    start = tiny_model()
    clean = serve(replica(start), optimizer="sgd", lr=0.1, policy=policy)
    expected = _train(clean.address, replica(start), steps, shm)

    dropper = DropPushReplies(every=3)
    if shm == "control-socket":
        dropper = DropSocketReplies(every=3)
        monkeypatch.setattr(ControlSocket, "push_pull", dropper.wrap(ControlSocket.push_pull))
    if shm == "data-port":
        dropper = DropSocketReplies(every=3)
        monkeypatch.setattr(TcpChannel, "_step", dropper.wrap(TcpChannel._step))
    lossy = serve(replica(start), optimizer="sgd", lr=0.1, policy=policy)
    got = _train(
        lossy.address,
        replica(start),
        steps,
        shm,
        transport=lambda a: Stub(grpc.intercept_channel(connect(a, DEADLINE), dropper)),
    )

    status = lossy.status()
    # sends 1, 4, 7, ... are dropped: iterations 0, 2, 4, ... each go twice
    assert dropper.dropped == steps // 2
    assert status["duplicates"] == dropper.dropped
    assert status["version"] == steps
    assert status["pushes_applied"] == steps
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_32_concurrent_workers_apply_exactly_the_pushes_they_made(serve):
    workers, lr = 32, 2.0**-10
    model = nn.Linear(8, 1, bias=False)
    nn.init.zeros_(model.weight)
    server = serve(replica(model), optimizer="sgd", lr=lr, policy="async", workers=workers)
    stop = threading.Event()
    ready = threading.Barrier(workers + 1, timeout=DEADLINE)

    def hammer() -> int:
        local = replica(model)
        with ps.Worker(server.address, local, name=threading.current_thread().name) as w:
            ready.wait()
            steps = 0
            while not stop.is_set():
                local.weight.grad = torch.ones_like(local.weight)
                w.step(samples=1)
                steps += 1
        return steps

    threads = [WorkerThread(hammer, f"load-{i}") for i in range(workers)]
    for t in threads:
        t.start()
    ready.wait()
    stop.wait(3.0)  # the bounded load period
    stop.set()
    made = sum(t.result() for t in threads)

    status = server.status()
    print(f"{workers} workers made {made} pushes in 3s")
    assert made > workers
    assert status["pushes_applied"] == made
    assert status["version"] == made
    assert status["duplicates"] == 0
    # all-ones gradients under plain SGD from zero: every weight is exactly -lr * pushes
    weights = server.coordinator.store.snapshot()
    np.testing.assert_array_equal(weights, np.full(8, -lr * made, dtype=np.float32))
