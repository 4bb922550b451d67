"""Clients without the token: they may
learn SERVING or NOT_SERVING and nothing else, and hold nothing the workers need."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import paramserver as ps
from paramserver._proto import paramserver_pb2 as pb
from paramserver._proto import paramserver_pb2_grpc as pb_grpc
from paramserver.cluster.procs import READY_MARKER, Child, stop_all
from paramserver.config import Security
from paramserver.transport.health import MAX_WATCHES
from tests.conftest import DEADLINE, tiny_model

TOKEN = "s3cret"
SERVING = health_pb2.HealthCheckResponse.SERVING


def _train(address: str, steps: int) -> int:
    model = tiny_model()
    with ps.Worker(address, model, security=Security(token=TOKEN), server_timeout=5.0) as w:
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            w.step(samples=1)
        return w.clock


def test_health_watches_without_the_token_cannot_starve_the_workers(serve):
    """Must 1: 40 Watch streams without the token (16 were enough to refuse every call of
    a one-worker server with RESOURCE_EXHAUSTED): at most MAX_WATCHES stay open, on no
    thread of the workers, the rest are refused, and a worker with the token trains. The
    open watches end when their time is up."""
    server = serve(tiny_model(), policy="async", workers=1, security=Security(token=TOKEN))
    # a connection each, as 41 clients
    channels = [
        grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(41)
    ]
    stubs = [health_pb2_grpc.HealthStub(c) for c in channels]
    streams = [s.Watch(health_pb2.HealthCheckRequest(), timeout=DEADLINE) for s in stubs[1:]]
    opened, refused = [], 0
    for s in streams:
        try:
            assert next(s).status == SERVING
            opened.append(s)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            refused += 1
    assert (len(opened), refused) == (MAX_WATCHES, 40 - MAX_WATCHES)
    checks = [
        stubs[0].Check.future(health_pb2.HealthCheckRequest(), timeout=DEADLINE) for _ in range(100)
    ]
    assert _train(server.address, 5) == 5  # while the watches stay open
    assert all(f.result().status == SERVING for f in checks)
    assert server.health.watching == MAX_WATCHES
    server.health.watch_seconds = 0.0
    server.health.expire()  # (or the server's reaper, whichever comes first)
    for s in opened:
        assert list(s) == []  # each stream ends, with OK
    assert server.health.watching == 0
    for c in channels:
        c.close()


def _peak_mib(pid: int) -> int:
    """The process's peak resident memory (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmHWM")


def test_calls_without_the_token_are_refused_before_their_body_is_read(tmp_path, monkeypatch):
    """Must 4: eight 16 MiB Joins without the token at once (each was received and parsed
    before its refusal: six 60 MiB ones took a server from 325 MB to 624 MB) leave the
    server's peak memory well under what reading them would take (128 MiB of bodies, twice
    that parsed); a message over the receive limit (17 MiB) is refused by gRPC before it is
    read. What does get in is what gRPC's flow control lets through before the refusal: its
    window grows with the link's measured bandwidth-delay product and the refusal waits for
    a thread, so it varies with load (11 to 19 MiB idle here, 71 MiB once on a loaded
    2-core CI machine)."""
    monkeypatch.setenv("PARAMSERVER_TOKEN", TOKEN)
    server = Child(
        "server",
        ["server", "--host", "127.0.0.1", "--port", "0", "--model", "mlp", "--workers", "1"]
        + ["--run-dir", "off"],  # its own evaluation is not what this test looks at
        tmp_path / "server.log",
        capture_stdout=True,
    )
    try:
        address = server.wait_for_line(READY_MARKER, DEADLINE).rsplit(" ", 1)[-1]
        channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
        stub = pb_grpc.ParameterServerStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE).status == SERVING
        before = _peak_mib(server.proc.pid)
        big = "x" * (16 << 20)
        codes: list[grpc.StatusCode] = []

        def join() -> None:
            try:
                stub.Join(pb.JoinRequest(name=big), timeout=DEADLINE)
            except grpc.RpcError as err:
                codes.append(err.code())

        threads = [threading.Thread(target=join) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE)
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 8
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="x" * (18 << 20)), timeout=DEADLINE)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        grown = _peak_mib(server.proc.pid) - before
        print(f"peak memory grew by {grown} MiB")
        assert grown < 100, grown
        channel.close()
    finally:
        stop_all([server])


def test_the_metrics_listen_on_loopback_unless_opened(serve):
    """Must 5: the Prometheus endpoint has no token and shows worker names and the loss:
    it listens on 127.0.0.1 even when the server listens on every interface, and on
    another address only when --metrics-host says so."""
    closed = serve(tiny_model(), host="0.0.0.0", metrics_port=0)
    assert closed.metrics._http.server_address[0] == "127.0.0.1"
    opened = serve(tiny_model(), host="127.0.0.1", metrics_port=0, metrics_host="0.0.0.0")
    assert opened.metrics._http.server_address[0] == "0.0.0.0"
