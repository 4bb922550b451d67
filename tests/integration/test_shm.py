"""The same-host shared-memory path: when it is taken, that it computes exactly what the gRPC
streams compute, what the server refuses, and that prefetching keeps the staleness bound."""

from __future__ import annotations

import os
import re

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver._proto import paramserver_pb2 as pb
from paramserver.training import data
from paramserver.transport import attachments, shm
from paramserver.transport.stub import Stub, connect
from tests.conftest import replica, tiny_model

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm here")


def _segments() -> set[str]:
    # This process's only (its name holds the pid): other test processes run beside it.
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"paramserver-{os.getpid()}-")}


def _train(server: ps.ServerApp, model: torch.nn.Module, steps: int, **worker_kw) -> ps.Worker:
    ds = data.synthetic(train=steps * 32, test=32)
    worker = ps.Worker(server.address, model, **worker_kw)
    for i in range(steps):
        x, y = ds.train_x[i * 32 : (i + 1) * 32], ds.train_y[i * 32 : (i + 1) * 32]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        worker.step(samples=len(x), loss=loss.item())
    return worker


# how a worker's steps travel: the payloads, and the control of each step (and, for one, the
# server's settings)
PATHS = {
    "segment, control socket": {"shm": True, "shm_control": True},
    "segment, control socket, optimizer thread": {
        "shm": True,
        "shm_control": True,
        "server": {"optimizer_thread": True},
    },
    "segment, gRPC control": {"shm": True, "shm_control": False},
    "gRPC streams": {"shm": False},
}


@pytest.mark.parametrize("policy", ["sync", "delay-1", "async"])
def test_shared_memory_gives_the_same_weights_as_streaming(serve, policy):
    results = {}
    for path, kw in PATHS.items():
        kw = dict(kw)
        model = tiny_model()
        server = serve(
            replica(model), optimizer="adam", policy=policy, workers=1, **kw.pop("server", {})
        )
        before = _segments()
        worker = _train(server, model, 12, **kw)
        try:
            assert worker.shm_active is kw["shm"]
            assert worker.control_active is kw.get("shm_control", False)
            assert _segments() == before  # the name is gone once the server mapped it
            assert server.status()["version"] == 12
            results[path] = server.coordinator.store.weights.copy()
        finally:
            worker.close()
    for path in PATHS:
        np.testing.assert_array_equal(results[path], results["gRPC streams"])


def test_prefetching_trains_within_the_bound_and_applies_every_push(serve):
    model = tiny_model()
    server = serve(replica(model), optimizer="adam", lr=3e-3, policy="delay-1", workers=1)
    worker = _train(server, model, 40, overlap=True)
    try:
        assert worker.prefetching
        worker.flush()
        status = server.status()
        assert status["pushes_applied"] == 40 == worker.clock
        assert status["max_staleness"] <= 1
        # prefetching means computing on weights without the own last push: staleness 1 seen
        assert status["staleness_histogram"].get(1, 0) > 0
    finally:
        worker.close()
    assert server.status()["workers"] == []


@pytest.mark.parametrize("sealed", [False, True] if shm.sealing_available() else [False])
def test_a_worker_streams_when_the_server_cannot_open_its_segment(serve, monkeypatch, sealed):
    server = serve("mlp", workers=1)
    # As if on another host: the server looks for a named segment under another folder, and
    # for a sealed one under another process.
    monkeypatch.setattr(attachments, "SHM_DIR", "/nonexistent-shm")
    monkeypatch.setattr(shm, "sealing_available", lambda: sealed)
    opened = attachments.Attachments._open
    monkeypatch.setattr(
        attachments.Attachments,
        "_open",
        staticmethod(lambda worker, name: opened(worker, re.sub(r"-\d+-", "-999999999-", name))),
    )
    before = _segments()
    with ps.Worker(server.address) as worker:
        assert not worker.shm_active
        assert _segments() == before  # the declined segment is gone too
        for p in worker.model.parameters():
            p.grad = torch.ones_like(p)
        worker.step(samples=1)
        assert server.status()["version"] == 1


@pytest.mark.parametrize("sealed", [False, True] if shm.sealing_available() else [False])
def test_the_server_refuses_a_segment_that_is_not_the_workers(tmp_path, sealed):
    seg = shm.Segment(1024, 2, sealed=sealed)
    try:
        att = attachments.Attachments(1024)
        assert not att.attach("w1", seg.name, b"x" * shm.NONCE_BYTES, 2)  # another nonce
        assert not att.attach("w1", seg.name, seg.nonce, 1)  # another size
        assert not att.attach("w1", "../etc/passwd", seg.nonce, 2)  # not a segment name
        assert not att.attach("w1", "paramserver-missing", seg.nonce, 2)
        assert not att.has("w1")
        assert att.attach("w1", seg.name, seg.nonce, 2)
        seg.slots[1][:] = 7.0
        assert float(att.gradient("w1", 1)[0]) == 7.0
        att.put_weights("w1", np.full(256, 3.0, np.float32))
        assert float(seg.weights[255]) == 3.0
        with pytest.raises(ps.ParamServerError, match="slot 2"):
            att.gradient("w1", 2)
        att.detach("w1")
        with pytest.raises(ps.ParamServerError, match="no segment"):
            att.gradient("w1", 0)
        att.close()
    finally:
        seg.close()
    assert sealed or not os.path.exists(seg.path)  # a sealed one has no name to remove


def test_shared_memory_requests_without_a_segment_are_refused(serve):
    server = serve("mlp", workers=2, min_workers=1)
    with ps.Worker(server.address, shm=False) as worker:
        channel = connect(server.address, 10)
        stub = Stub(channel)
        try:
            header = pb.PushHeader(
                worker_id=worker.worker_id,
                iteration=worker.clock,
                shm=True,
                shm_slot=0,
                incarnation=worker.incarnation,
            )
            for request in (
                pb.PushPullRequest(push=header),
                pb.PushPullRequest(push=pb.PushHeader(worker_id=worker.worker_id)),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    stub.PushPull(request, timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            pull = pb.PullRequest(worker_id=worker.worker_id, iteration=worker.clock, shm=True)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Pull(pull, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert server.status()["version"] == 0
        finally:
            channel.close()


@pytest.mark.parametrize("compress", ["fp16", "bf16"])
def test_compressed_streamed_pushes_train_like_float32_ones(serve, compress):
    results = {}
    for mode in ("none", compress):
        model = tiny_model()
        server = serve(replica(model), optimizer="sgd", lr=0.1, policy="sync", workers=1)
        worker = _train(server, model, 12, shm=False, compress=mode)
        try:
            assert server.status()["version"] == 12
            results[mode] = server.coordinator.store.weights.copy()
        finally:
            worker.close()
    delta = np.abs(results[compress] - results["none"]).max()
    assert 0 < delta < 1e-2, delta  # rounded gradients: close, not equal


def test_a_prefetching_worker_dropped_by_the_server_joins_again_and_goes_on(serve):
    model = tiny_model()
    server = serve(replica(model), optimizer="sgd", lr=0.01, policy="async", workers=1)
    ds = data.synthetic(train=64 * 32, test=32)
    with ps.Worker(server.address, model, overlap=True) as worker:
        assert worker.prefetching

        def step(i: int) -> None:
            x, y = ds.train_x[i * 32 : (i + 1) * 32], ds.train_y[i * 32 : (i + 1) * 32]
            F.cross_entropy(model(x), y).backward()
            worker.step(samples=len(x))

        for i in range(10):
            step(i)
        # The server drops the worker (as when its lease runs out) with a call in flight.
        server.coordinator.leave(worker.worker_id)
        for i in range(10, 30):
            step(i)
        assert worker.rejoins == 1
        worker.flush()
        applied = server.status()["pushes_applied"]
    # every push but the one or two in flight when it was dropped
    assert 27 <= applied <= 30, applied
    assert server.status()["workers"] == []


def test_blocking_steps_pull_into_the_model_in_place_and_rebind_after_a_rejoin(serve):
    model = tiny_model()
    server = serve(replica(model), optimizer="sgd", lr=0.01, policy="async", workers=1)
    with ps.Worker(server.address, model) as worker:
        assert worker.mode.value == "blocking"

        def in_segment() -> bool:
            weights = worker.sessions[0].channel.weights
            span = (weights.data_ptr(), weights.data_ptr() + weights.nbytes)
            return all(span[0] <= p.data_ptr() < span[1] for p in model.parameters())

        assert worker._replica.bound == len(list(model.parameters())) and in_segment()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        worker.step(samples=1)
        # the pull wrote the server's weights into the model itself
        got = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        np.testing.assert_array_equal(got, server.coordinator.store.weights)
        server.coordinator.leave(worker.worker_id)  # dropped: the next step joins again
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        worker.step(samples=1)
        assert worker.rejoins == 1 and in_segment()  # the new segment's
        got = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        np.testing.assert_array_equal(got, server.coordinator.store.weights)
    with ps.Worker(server.address, replica(model), overlap=True) as ahead:
        assert ahead.prefetching and ahead._replica.bound == 0  # pulls land while it computes
