"""gRPC health checking and Prometheus metrics, scraped from a real server during training."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from paramserver.config import Security, WorkerConfig
from paramserver.server.metrics import SOCKET_METHOD
from paramserver.training.trainer import run
from tests.conftest import WorkerThread

SERVICE = "paramserver.v1.ParameterServer"


def _check(address: str, service: str = SERVICE) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def scrape(port: int) -> dict[str, list]:
    """Every sample of /metrics, by sample name: [(labels, value)]."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def one(samples: dict[str, list], name: str, **labels: str) -> float:
    values = [v for lab, v in samples[name] if all(lab.get(k) == x for k, x in labels.items())]
    assert len(values) == 1, (name, labels, samples.get(name))
    return values[0]


def test_metrics_follow_a_training_run(serve, tmp_path):
    server = serve(
        "mlp",
        policy="delay-1",
        workers=2,
        dataset="synthetic",
        batch_size=64,
        epochs=1,
        host="127.0.0.1",
        metrics_port=0,
        checkpoint_dir=str(tmp_path),
        checkpoint_every="10",
    )
    assert _check(server.address) == health_pb2.HealthCheckResponse.SERVING
    before = scrape(server.metrics.port)
    assert one(before, "paramserver_version") == 0
    assert one(before, "paramserver_live_workers") == 0

    threads = [
        WorkerThread(lambda i=i: run(WorkerConfig(server.address, device="cpu", name=f"w{i}")))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    assert server.wait_for_version(20, 120)
    during = scrape(server.metrics.port)
    lags = {lab["name"]: v for lab, v in during["paramserver_worker_clock_lag"]}
    assert set(lags) == {"w0", "w1"} and all(0 <= v <= 2 for v in lags.values())
    assert one(during, "paramserver_live_workers") == 2
    for t in threads:
        t.result()

    after = scrape(server.metrics.port)
    status = server.status()
    assert one(after, "paramserver_version") == status["version"] == 64
    assert one(after, "paramserver_pushes_applied_total") == 64
    assert one(after, "paramserver_pulls_total") == status["pulls_answered"] >= 64
    assert one(after, "paramserver_received_bytes_total") == status["bytes_in"] > 0
    assert one(after, "paramserver_batches_done") == one(after, "paramserver_batches_total") == 64
    assert one(after, "paramserver_barrier_wait_seconds_total") >= 0
    assert one(after, "paramserver_checkpoint_age_seconds") >= 0
    # every pull's staleness is in the histogram; under delay-1 none is above 1
    assert one(after, "paramserver_staleness_count") == status["pulls_answered"]
    assert one(after, "paramserver_staleness_bucket", le="1.0") == status["pulls_answered"]
    # latency of every RPC, by method; workers on this host push (and pull) with PushPull,
    # on the same-host control socket
    calls = {lab["method"]: v for lab, v in after["paramserver_rpc_seconds_count"]}
    steps = calls.get("PushPull", 0) + calls.get(SOCKET_METHOD, 0)
    assert calls.get("Push", 0) + steps >= 64
    assert calls.get("Pull", 0) + steps >= 64
    method = next(m for m in (SOCKET_METHOD, "PushPull", "Push") if m in calls)
    assert one(after, "paramserver_rpc_seconds_sum", method=method) > 0

    server.stop()
    with pytest.raises(grpc.RpcError):
        _check(server.address)


def test_health_needs_no_token_and_reports_not_serving_before_start(serve):
    from paramserver.config import ServerConfig
    from paramserver.server.app import ServerApp

    app = ServerApp(ServerConfig(host="127.0.0.1", port=0, security=Security(token="t0k")))
    assert app.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), None).status == (
        health_pb2.HealthCheckResponse.NOT_SERVING
    )
    app.start()
    try:
        assert _check(app.address) == health_pb2.HealthCheckResponse.SERVING
        assert _check(app.address, "") == health_pb2.HealthCheckResponse.SERVING
    finally:
        app.stop(grace=0)
