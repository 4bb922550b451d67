"""Prometheus metrics of a server: RPC latencies timed by an interceptor, and the
coordinator's state read at scrape time. Served over HTTP on ``--metrics-port``.

Each server has its own registry, so several servers in one process (tests) do not clash.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from paramserver.server import metrics_http
from paramserver.server.bookkeeping.status import ServerStatus
from paramserver.transport.handlers import Behavior, wrap_handler
from paramserver.transport.security import HEALTH_PREFIX

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32, 64, 128)


class StatusCollector(Collector):
    """Turns ``status()`` (the same figures as the Status RPC) into metrics at scrape time."""

    def __init__(self, status: Callable[[], ServerStatus]):
        self._status = status

    def collect(self) -> Iterable[Metric]:
        s = self._status()
        yield from _totals(s)
        yield from _per_worker(s)
        yield _histogram(s.staleness_histogram)


def _totals(s: ServerStatus) -> Iterator[Metric]:
    """The server's figures, one metric each."""
    yield _gauge("version", "Optimizer steps applied.", s.version)
    yield _gauge("live_workers", "Workers holding a lease.", len(s.workers))
    yield _counter("pushes_applied", "Gradients accepted.", s.pushes_applied)
    yield _counter("pulls", "Worker pulls answered.", s.pulls_answered)
    yield _counter("duplicate_pushes", "Retried pushes acknowledged, not applied.", s.duplicates)
    yield _counter("skipped_pushes", "Non-finite gradients skipped.", s.pushes_skipped)
    yield _counter(
        "late_pushes",
        "Sync gradients dropped because their round closed without them (--backup-workers).",
        s.pushes_late,
    )
    yield _counter(
        "coalesced_pushes",
        "Gradients applied in one optimizer step with others (--coalesce on).",
        s.pushes_coalesced,
    )
    yield _counter(
        "apply_failures", "Gradients lost because the optimizer's step raised.", s.apply_failures
    )
    yield _counter(
        "compensated_pushes",
        "Gradients delay-compensated for the updates they missed (--delay-compensation).",
        s.pushes_compensated,
    )
    yield _counter(
        "uncompensated_pushes",
        "Gradients applied as they came, no read of theirs kept (--delay-compensation).",
        s.pushes_uncompensated,
    )
    yield from _traffic(s)
    yield from _disk_and_rows(s)


def _traffic(s: ServerStatus) -> Iterator[Metric]:
    """Bytes, samples, waits and progress."""
    yield _counter("received_bytes", "Gradient bytes received.", s.bytes_in)
    yield _counter("sent_bytes", "Weight bytes sent.", s.bytes_out)
    yield _counter("samples", "Training samples behind the accepted gradients.", s.samples)
    yield _counter(
        "barrier_wait_seconds",
        "Time pulls waited for the staleness policy.",
        s.barrier_wait_seconds,
    )
    yield _gauge("batches_done", "Batches of the run applied.", s.batches_done)
    yield _gauge("batches_total", "Batches in the whole run.", s.batches_total)
    yield _gauge("learning_rate", "Learning rate of the next optimizer step.", s.learning_rate)
    yield _gauge("train_loss", "Moving average of pushed batch losses.", s.train_loss)
    if s.tested_epoch:
        yield _gauge("tested_epoch", "The last epoch the server evaluated.", s.tested_epoch)
        yield _gauge("test_accuracy", "Test accuracy after that epoch.", s.test_accuracy)
        yield _gauge(
            "test_loss", "Test loss after that epoch (--loss; cross-entropy).", s.test_loss
        )
        if math.isfinite(s.test_perplexity):
            yield _gauge(
                "test_perplexity", "exp(test cross-entropy) after that epoch.", s.test_perplexity
            )
        if math.isfinite(s.test_auc):
            yield _gauge("test_auc", "Test AUC after that epoch (click models).", s.test_auc)
    yield _counter(
        "evaluation_failures",
        "The server's evaluations after an epoch that raised (each retried).",
        s.evaluation_failures,
    )


def _disk_and_rows(s: ServerStatus) -> Iterator[Metric]:
    """Checkpoints, cuts and sparse rows."""
    if s.checkpoint_age_seconds >= 0:
        yield _gauge(
            "checkpoint_age_seconds",
            "Seconds since the last checkpoint was written.",
            s.checkpoint_age_seconds,
        )
    yield _counter(
        "checkpoint_failures", "Checkpoint or cut writes that failed.", s.checkpoint_failures
    )
    yield _gauge(
        "checkpoint_failing_seconds",
        "Seconds since checkpoint writes began failing; 0 while the last write succeeded.",
        max(s.checkpoint_failing_seconds, 0.0),
    )
    yield _gauge("cuts_pending", "Consistent cuts taken and not yet on disk.", s.cuts_pending)
    yield _gauge("rows_held", "Sparse table rows held (created by their first push).", s.rows_held)
    by_table = GaugeMetricFamily(
        "paramserver_table_rows", "Sparse table rows this shard holds, by table.", labels=["table"]
    )
    for table, rows in sorted(s.table_rows.items()):
        by_table.add_metric([table], rows)
    yield by_table
    for name, doc in LIFECYCLE.items():
        family = CounterMetricFamily(f"paramserver_table_{name}", doc, labels=["table"])
        for table, count in sorted(getattr(s, f"table_{name}").items()):
            family.add_metric([table], count)
        yield family
    yield _counter("rows_pulled", "Sparse table rows sent to workers.", s.rows_pulled)
    yield _counter("rows_pushed", "Sparse table row gradients applied.", s.rows_pushed)


LIFECYCLE = {  # sparse/lifecycle.py; this process is one shard
    "admitted": "Sparse table rows created (a first push, or an admission), by table.",
    "evicted": "Sparse table rows evicted (capacity or TTL), by table.",
    "dropped": "Sparse table gradient rows dropped (ids not admitted yet, or past the "
    "capacity), by table.",
    "reborn": "Sparse table rows created again after their eviction, by table.",
}


def _per_worker(s: ServerStatus) -> Iterator[Metric]:
    """The live workers' figures, labelled by worker."""
    cache = GaugeMetricFamily(
        "paramserver_worker_row_cache",
        "Distinct ids a worker's forward passes found in its row caches (hit) or fetched "
        "(miss), so far, as its last push said.",
        labels=["worker_id", "name", "rank", "result"],
    )
    for w in s.workers:
        for result, value in (("hit", w.row_cache_hits), ("miss", w.row_cache_misses)):
            cache.add_metric([w.worker_id, w.name, str(w.rank), result], value)
    yield cache
    lag = GaugeMetricFamily(
        "paramserver_worker_clock_lag",
        "Iterations a worker is behind the fastest live worker.",
        labels=["worker_id", "name", "rank"],
    )
    for w in s.workers:
        lag.add_metric([w.worker_id, w.name, str(w.rank)], w.lag)
    yield lag


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"paramserver_{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"paramserver_{name}", doc, value=value)


def _histogram(counts: dict[int, int]) -> HistogramMetricFamily:
    """The staleness of every answered pull as a cumulative histogram."""
    buckets, total, weighted = [], 0, 0
    for bound in STALENESS_BUCKETS:
        buckets.append((str(float(bound)), sum(n for k, n in counts.items() if k <= bound)))
    for k, n in counts.items():
        total += n
        weighted += k * n
    buckets.append(("+Inf", total))
    return HistogramMetricFamily(
        "paramserver_staleness",
        "Staleness (iteration minus the slowest live clock) of each answered pull.",
        buckets=buckets,
        sum_value=weighted,
    )


class LatencyInterceptor(grpc.ServerInterceptor):
    """Times every RPC (a pull until its last chunk is sent) into one histogram."""

    def __init__(self, histogram: Histogram):
        self._histogram = histogram

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            # health keeps its own handlers: non-blocking watches, calls on its side pool
            return handler
        observe = self._histogram.labels(details.method.rsplit("/", 1)[-1]).observe
        return wrap_handler(handler, lambda inner, streaming: _timed(inner, streaming, observe))


def _timed(inner: Behavior, streaming: bool, observe: Callable[[float], None]) -> Behavior:
    """``inner`` timed into ``observe``: a streamed answer until its last message is sent."""
    if streaming:

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            started = time.perf_counter()
            try:
                yield from inner(request, context)
            finally:
                observe(time.perf_counter() - started)

        return stream

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            return inner(request, context)
        finally:
            observe(time.perf_counter() - started)

    return unary


SOCKET_METHOD = "SocketPushPull"  # the method label of steps on the control socket
DATA_METHOD = "DataPushPull"  # and of steps on the data port, from receipt to answer


class Metrics:
    """The registry of one server, its latency interceptor and its HTTP endpoint."""

    def __init__(self, status: Callable[[], ServerStatus]):
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "paramserver_rpc_seconds",
            "Time to serve an RPC, by method (Push: receive and apply; Pull: wait and send; "
            f"{SOCKET_METHOD}: a step on the same-host control socket; {DATA_METHOD}: a "
            "step on the data port, its gradient received).",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(StatusCollector(status))
        self.interceptor = LatencyInterceptor(self.latency)
        self._http: Any = None
        self.port = 0

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on ``host:port`` (0: any free port); returns the port."""
        self._http = metrics_http.serve(host, port, self.registry)
        self.port = self._http.server_port
        return self.port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
