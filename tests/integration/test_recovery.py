"""Recovery where faults meet: each test
names the guarantee it checks, against real servers on 127.0.0.1."""

from __future__ import annotations

import copy
import os
import re
import resource
import signal
import time
import urllib.request
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

import paramserver as ps
from paramserver._proto import paramserver_pb2 as pb
from paramserver.cluster.procs import READY_MARKER, Child, stop_all
from paramserver.codec.records import ControlError
from paramserver.server.app import CHECKPOINT_HEALTH
from paramserver.transport.stub import Stub, connect
from tests.conftest import (
    DEADLINE,
    WorkerThread,
    free_port,
    ones_step,
    paramserver_run,
    tiny_model,
)


class LosesFirstJoinReply:
    """A worker's stub whose first Join reaches the server but whose reply is lost (the
    call fails with UNAVAILABLE, as a dropped connection makes it)."""

    def __init__(self, address: str):
        self._stub = Stub(connect(address, DEADLINE))
        self.lost = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def Join(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        reply = self._stub.Join(request, timeout=timeout)
        if not self.lost:
            self.lost += 1
            raise ControlError(grpc.StatusCode.UNAVAILABLE, "the Join reply was lost")
        return reply


def test_join_is_idempotent_a_retried_join_whose_reply_was_lost_admits_no_ghost(serve):
    """Guarantee 4: a retry of a join attempt whose reply was lost gets the member that
    attempt admitted: no second rank, slot or lease. Both workers of a two-worker sync run
    are admitted at once (a ghost would hold the second slot for its 8 s lease: ClusterFull
    past the 3 s the workers wait) and train together."""
    server = serve(tiny_model(), policy="sync", workers=2, lease_seconds=8.0)
    stubs: list[LosesFirstJoinReply] = []

    def transport(address: str) -> LosesFirstJoinReply:
        stubs.append(LosesFirstJoinReply(address))
        return stubs[-1]

    def train() -> int:
        model = tiny_model()
        with ps.Worker(
            server.address, model, transport=transport, server_timeout=3.0, overlap=False
        ) as w:
            for _ in range(3):
                for p in model.parameters():
                    p.grad = torch.ones_like(p)
                w.step(samples=1)
            return w.rank

    threads = [WorkerThread(train, f"worker-{i}") for i in range(2)]
    for t in threads:
        t.start()
    ranks = sorted(t.result() for t in threads)
    assert all(s.lost == 1 for s in stubs)  # every worker's first Join reply was lost
    status = server.status()
    assert ranks == [0, 1]
    assert status["workers_joined"] == 2  # one member per worker, no ghost
    assert status["rounds"] == 3


def _status(address: str) -> pb.StatusResponse | None:
    try:
        with grpc.insecure_channel(address) as channel:
            return Stub(channel).Status(pb.StatusRequest(), timeout=10)
    except grpc.RpcError:
        return None


def _wait(address: str, what: str, predicate) -> pb.StatusResponse:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        st = _status(address)
        if st is not None and predicate(st):
            return st
        time.sleep(0.05)  # polling another process's status; bounded by the deadline
    raise AssertionError(f"timed out waiting for {what}; last status: {st}")


def _checkpoint_health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=CHECKPOINT_HEALTH)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


CKPT_EVERY = 5  # optimizer steps


def _ckpt_server(tmp_path, n: int, port: int = 0, metrics: int | None = None) -> Child:
    args = [
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "async",
        "--workers",
        "1",
        "--dataset",
        "synthetic",
        "--batch-size",
        "16",
        "--epochs",
        "50",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--model",
        "mlp",
        "--lease-timeout",
        "30",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        str(CKPT_EVERY),
    ]
    if metrics is not None:
        args += ["--metrics-port", str(metrics)]
    return Child(f"server-{n}", args, tmp_path / f"server-{n}.log", capture_stdout=True)


def test_a_failed_checkpoint_write_never_ends_checkpointing(tmp_path):
    """Guarantee 1: checkpoint writes that fail (here a file-size limit set on the running
    server, as a full disk would) are logged with the path and the reason, shown by status,
    `paramserver status`, the checkpoint health service and Prometheus, and retried with
    backoff; once writes succeed again checkpoints resume, and a kill -9 after that loses
    at most one checkpoint interval."""
    procs: list[Child] = []
    try:
        metrics_port = free_port()
        server = _ckpt_server(tmp_path, 1, metrics=metrics_port)
        procs.append(server)
        address = server.wait_for_line(READY_MARKER, DEADLINE).rsplit(" ", 1)[-1]
        worker = Child(
            "worker",
            [
                "worker",
                "--server",
                address,
                "--device",
                "cpu",
                "--step-delay",
                "0.01",
                "--server-timeout",
                "120",
            ],
            tmp_path / "worker.log",
        )
        procs.append(worker)
        _wait(address, "a first checkpoint", lambda s: s.checkpoint_version >= CKPT_EVERY)
        assert _checkpoint_health(address) == health_pb2.HealthCheckResponse.SERVING

        # every write of more than 4 KiB fails with EFBIG (torch.save: RuntimeError)
        _, hard = resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (4096, hard))
        failing = _wait(address, "failing writes", lambda s: s.checkpoint_failures >= 2)
        assert failing.checkpoint_failing_seconds >= 0
        assert str(tmp_path / "ckpt") in failing.checkpoint_error, failing.checkpoint_error
        assert _checkpoint_health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        text = scraped.read().decode()
        assert re.search(r"^paramserver_checkpoint_failures_total [1-9]", text, re.M), text
        shown = paramserver_run("status", "--server", address)
        assert shown.returncode == 0, shown.stderr
        assert "CHECKPOINTS FAILING" in shown.stdout, shown.stdout
        probe = paramserver_run("health", "--server", address, "--service", CHECKPOINT_HEALTH)
        assert probe.returncode != 0 and "NOT_SERVING" in probe.stderr, probe
        assert "retrying in" in server.log_path.read_text()
        stuck = _status(address)
        assert stuck is not None

        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))
        again = _wait(
            address,
            "checkpoints again",
            lambda s: s.checkpoint_failing_seconds < 0 and s.checkpoint_version > stuck.version,
        )
        assert again.checkpoint_error == ""
        assert _checkpoint_health(address) == health_pb2.HealthCheckResponse.SERVING

        # kill -9 at a moment the test knows the version of: the only worker stopped
        os.kill(worker.proc.pid, signal.SIGSTOP)
        frozen = _wait(address, "the version to settle", lambda s: s.version == _version(address))
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(DEADLINE)
        port = int(address.rsplit(":", 1)[1])
        restarted = _ckpt_server(tmp_path, 2, port=port)
        procs.append(restarted)
        restarted.wait_for_line(READY_MARKER, DEADLINE)
        resumed = _status(address)
        assert resumed is not None
        assert frozen.version - resumed.version <= CKPT_EVERY, (frozen.version, resumed.version)
        print(f"killed at version {frozen.version}, resumed at {resumed.version}")
    finally:
        stop_all(procs)


def _version(address: str) -> int:
    st = _status(address)
    return -1 if st is None else st.version


class PushesNeverArrive:
    """A worker's stub for one shard whose pushes never arrive: the worker dies (its push
    fails past --server-timeout) after its push reached the other shard, or before."""

    def __init__(self, address: str):
        self._stub = Stub(connect(address, DEADLINE))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def Push(self, chunks: Any, timeout: float | None = None) -> Any:  # noqa: N802
        raise ControlError(grpc.StatusCode.UNAVAILABLE, "the shard is cut off")


@pytest.mark.parametrize("policy", ["async", "sync"])
@pytest.mark.parametrize("cut_off", [0, 1])
def test_each_shard_applies_each_batch_once_when_a_worker_dies_between_its_pushes(
    serve, policy, cut_off
):
    """Guarantee 3: a worker that dies after its push of a batch reached shard 1 but before
    shard 0 makes shard 0 hand the batch out again; shard 1 finds it applied and applies
    the second gradient of it not at all. One that cannot reach shard 1 never pushes to
    shard 0 (shard 0 goes last), so the batch is not counted done where shard 1 lacks it.
    A one-batch run, SGD lr 1, gradients of ones: each shard's weights move by exactly 1
    and both count one batch."""
    start = nn.Linear(8, 1, bias=False)
    nn.init.zeros_(start.weight)
    shards = [
        serve(
            copy.deepcopy(start),
            optimizer="sgd",
            lr=1.0,
            momentum=0.0,
            policy=policy,
            workers=2,
            min_workers=1,
            batch_size=64,
            epochs=1,
            shard=i,
            shards=2,
        )
        for i in range(2)
    ]
    addresses = [s.address for s in shards]

    def cut_off_from_a_shard(address: str) -> Any:
        if address == addresses[cut_off]:
            return PushesNeverArrive(address)
        return Stub(connect(address, DEADLINE))

    first = copy.deepcopy(start)
    dying = ps.Worker(
        addresses,
        first,
        train_samples=64,
        transport=cut_off_from_a_shard,
        shm=False,
        wire="grpc",  # the cut is in the gRPC stub's Push
        overlap=False,
        server_timeout=1.0,
    )
    assert dying.batches == [0]
    with pytest.raises(ps.ServerUnavailable):
        ones_step(dying, first, 64)
    dying.close()  # it leaves: shard 0 hands batch 0 out again at once

    second = copy.deepcopy(start)
    with ps.Worker(addresses, second, train_samples=64, overlap=False) as again:
        assert again.batches == [0]
        ones_step(again, second, 64)
        assert again.finished
    one, two = (s.status() for s in shards)
    for st in (one, two):
        assert st["batches_applied"] == 1 and st["samples"] == 64, st
    assert one["batches_done"] == 1 and one["pushes_repeated"] == 0
    # shard 1 took the dying worker's push only when shard 0 was the one cut off: then
    # it found the second gradient of batch 0 applied already
    assert two["pushes_repeated"] == (1 if cut_off == 0 else 0)
    for s in shards:  # each shard's range moved by exactly one gradient of ones
        np.testing.assert_array_equal(s.coordinator.store.weights, -1.0)
