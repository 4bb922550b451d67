"""Wiring of a server process: model -> store -> coordinator (``build.py``) -> gRPC; start,
ready, stop."""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

from paramserver import models
from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import layout
from paramserver.config import MAX_MESSAGE_BYTES, ServerConfig
from paramserver.config.cores import host_cores, server_threads
from paramserver.errors import ConfigError
from paramserver.server.build import build_coordinator
from paramserver.server.disk.checkpoint_writer import Checkpointer, checkpoint_folder
from paramserver.server.doors.dataport import data_port
from paramserver.server.doors.doorbell import Doorbell
from paramserver.server.doors.servicer import Servicer
from paramserver.server.metrics import DATA_METHOD, SOCKET_METHOD, Metrics
from paramserver.sparse.tableset import whole_tables
from paramserver.transport import pieces, ports, security, stub
from paramserver.transport.attachments import Attachments
from paramserver.transport.health import BoundedHealth

log = logging.getLogger(__name__)

# The health service reports on the whole server ("") and on the parameter-server service.
HEALTH_SERVICES = ("", stub.SERVICE)
# ... and, with --checkpoint-dir, on its checkpoints: NOT_SERVING while writes fail (the
# server still trains; its status says since when and why), SERVING once one succeeds.
CHECKPOINT_HEALTH = "paramserver.v1.Checkpoints"
# Payloads are chunked, so no message is large: a payload chunk is at most 16 MiB
# (--chunk-bytes), a push's rows at most 8 MiB a message (codec/rows.py), a row pull's ids
# at most 16 MiB (sparse/remote.py). gRPC receives a message whole before any check of
# ours (the token's included) can refuse it, so the receive limit bounds what each call
# without the token can make the server hold (docs/operations.md). Answers (a row pull's
# rows) may be larger.
MAX_RECEIVE_BYTES = 17 << 20


# Hosts that bind every interface; clients on this machine dial 127.0.0.1 instead.
EVERY_INTERFACE = ("0.0.0.0", "::", "[::]", "")
# The reaper looks a quarter lease apart, but at least this often: it also ends the health
# watches past WATCH_SECONDS, which a long --lease-timeout must not keep open.
REAP_EVERY_MAX = 1.0


def _grpc_server(config: ServerConfig, timing: grpc.ServerInterceptor) -> grpc.Server:
    """The gRPC server of ``config`` (its security's interceptors, then ``timing``), not
    yet bound or started."""
    # Each worker holds at most a pull, a push, a heartbeat and its norm relay's StepNorm
    # (which waits up to 10 s) at once; blocked calls hold a thread each, so the pool is
    # sized to never starve a push.
    threads = 4 * config.workers + 8
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ps-rpc"),
        options=[
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=threads,
        interceptors=[*security.server_interceptors(config.security), timing],
    )


class ServerApp:
    """One parameter-server process: start(), address, wait(), stop(grace).

    Args:
        config: the validated server settings.
        model: a model instance whose weights start the run; by default the server builds
            ``config.model`` with ``config.seed``.

    Raises:
        ConfigError: (at construction) --checkpoint-dir cannot be made or written in, or
            what ``build_coordinator`` refuses.
    """

    def __init__(self, config: ServerConfig, model: nn.Module | None = None):
        self.config = config
        if config.checkpoint_dir:  # a folder it cannot write: refused before anything else
            checkpoint_folder(config.checkpoint_dir)
        self.threads, self.threads_from = server_threads(config.threads, 1, *host_cores())
        torch.set_num_threads(self.threads)
        pieces.set_threads(self.threads)
        if model is None:
            model = models.build(config.model, seed=config.seed)
        self.aliases = models.aliases(model)  # a tied head's second name, for state dicts
        self.coordinator = build_coordinator(config, model, resume=True)
        manifest = self.coordinator.manifest
        self.checkpointer: Checkpointer | None = None
        if config.checkpoint_dir:
            self.checkpointer = Checkpointer(
                self.coordinator,
                config.checkpoint_dir,
                config.checkpoint_every,
                cuts=config.cuts,
                on_health=self._checkpoint_health,
            )
        self.metrics = Metrics(self.coordinator.status)
        self._grpc = _grpc_server(config, self.metrics.interceptor)
        self.shared = Attachments(manifest.total_bytes, manifest.dtype)
        rewind = self.checkpointer.rewind if self.checkpointer and config.cuts else None
        servicer = Servicer(self.coordinator, self.shared, rewind)
        self._servicer = servicer
        self.doorbell = Doorbell(
            servicer.steps,
            self.shared,
            self.coordinator.notify,
            self.metrics.latency.labels(SOCKET_METHOD).observe,
        )
        self.data = data_port(servicer.steps, config, self.metrics.latency.labels(DATA_METHOD))
        stub.register(servicer, self._grpc)
        # gRPC health checking: SERVING from start() (the model is built by then) to stop().
        self.health = BoundedHealth()
        for service in HEALTH_SERVICES:
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.health.absent[CHECKPOINT_HEALTH] = (
            "this server writes no checkpoints (no --checkpoint-dir)"
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self.port = 0
        self._stopped = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="ps-lease-reaper", daemon=True)
        self.reaper_failures = 0

    @property
    def address(self) -> str:
        """host:port that clients on this machine can dial."""
        host = "127.0.0.1" if self.config.host in EVERY_INTERFACE else self.config.host
        return f"{host}:{self.port}"

    @property
    def bound(self) -> str:
        """host:port the server listens on, as bound (0.0.0.0: every interface)."""
        bound = f"{ports.bracketed(self.config.host)}:{self.port}"
        if self.config.host in EVERY_INTERFACE:
            return f"{bound} (every interface; dial {self.address} on this host)"
        return bound

    def start(self) -> ServerApp:
        """Bind and serve; returns once the server accepts calls.

        Raises:
            ConfigError: the port cannot be bound.
        """
        creds = security.server_credentials(self.config.security)
        self.port = 0
        self.port = ports.bind_grpc(self._grpc, self.config.host, self.config.port, creds)
        self._servicer.control = self.doorbell.start()
        self._start_data_port()
        self._grpc.start()
        if self.config.metrics_port is not None:
            self._serve_metrics()
        for service in HEALTH_SERVICES:
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._reaper.start()
        if self.checkpointer is not None:
            self._checkpoint_health(not self.coordinator.saves.failing)
            self.checkpointer.start()
        self._log_serving()
        return self

    def _start_data_port(self) -> None:
        """Serve the data port; the gRPC server stops if a port asked for cannot be bound.

        Raises:
            ConfigError: --data-port names a port that cannot be bound.
        """
        if self.data is None:
            return
        if self.data.start():
            self._servicer.data = self.data
            log.info("data port on %s:%d", ports.bracketed(self.config.host), self.data.port)
        elif self.config.data_port != "auto":
            self._grpc.stop(0)
            self.doorbell.close()
            raise ConfigError(
                f"Cannot serve the data port on {ports.bracketed(self.config.host)}:"
                f"{self.config.data_port} (see the log); --data-port off streams over gRPC."
            )

    def _serve_metrics(self) -> None:
        """Serve --metrics-port; the gRPC server stops if it cannot be bound.

        Raises:
            ConfigError: the metrics port cannot be bound.
        """
        host, port = self.config.metrics_host, self.config.metrics_port
        assert port is not None
        try:
            self.metrics.serve(host, port)
        except OSError as exc:
            self._grpc.stop(0)
            raise ConfigError(
                f"Cannot serve metrics on {ports.bracketed(host)}:{port}: {exc.strerror or exc}."
            ) from exc
        log.info("metrics on http://%s:%d/metrics", ports.bracketed(host), self.metrics.port)

    def _log_serving(self) -> None:
        c = self.config
        log.info(
            "serving %s (%d parameters, %.1f MiB) on %s%s: policy %s, optimizer %s lr %g, "
            "%d workers (training starts with %d), lease %.1fs, incarnation %s, version %d",
            c.model,
            self.coordinator.manifest.numel,
            self.coordinator.manifest.total_bytes / 2**20,
            self.bound,
            " (TLS)" if c.security.tls else "",
            self.coordinator.policy.name,
            c.optimizer.name,
            c.optimizer.lr,
            c.workers,
            c.start_workers,
            c.lease_seconds,
            self.coordinator.incarnation,
            self.coordinator.store.version,
        )
        log.info(
            "%d server threads (optimizer, checks, shared-memory copies): %s; weights and "
            "optimizer on %s",
            self.threads,
            self.threads_from,
            self.config.server_device,
        )
        if c.host in EVERY_INTERFACE and not c.security.token and not c.security.tls:
            log.warning(
                "listening on every interface with no token and no TLS: anyone who reaches "
                "port %d can join the run, push gradients into the model and read its "
                "weights; set PARAMSERVER_TOKEN (on the server and every worker) and/or "
                "--tls-cert/--tls-key, or listen on one address (--host 127.0.0.1)",
                self.port,
            )

    def _checkpoint_health(self, ok: bool) -> None:
        state = health_pb2.HealthCheckResponse
        self.health.set(CHECKPOINT_HEALTH, state.SERVING if ok else state.NOT_SERVING)

    def _reap(self) -> None:
        """Drop workers whose lease ran out, and end health watches past their time; a
        failure (of the wait too) is logged and counted, and the loop goes on."""
        lease = self.config.lease_seconds
        interval = min(max(lease / 4, 0.05), REAP_EVERY_MAX)
        last = time.monotonic()
        while not self._stopped.is_set():
            try:
                if self._stopped.wait(interval):
                    return
                now = time.monotonic()
                gap, last = now - last, now
                # a look later than half a lease past its time: the process was not running
                paused = gap - interval if gap > interval + lease / 2 else 0.0
                # leases judged at the look: a process stopped between it and the lock
                # (waiting on an apply) would find every lease run out when it went on,
                # and no gap to say it was stopped (the gap is seen at the next look)
                for member in self.coordinator.expire_leases(paused, at=now):
                    self.shared.detach(member.worker_id)
                self.health.expire()
            except Exception:  # noqa: BLE001 - leases must keep expiring: say it, go on
                self.reaper_failures += 1
                log.exception(
                    "the lease reaper failed (%d times); it goes on", self.reaper_failures
                )
                self._stopped.wait(REAP_EVERY_MAX)  # a failure that repeats: not a busy loop

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers as this server holds them now, with its sparse
        tables whole (untouched rows at their seeded initial values), for
        ``model.load_state_dict``. A table that is unbounded or over 1 GiB whole is left
        out, with a warning, as ``ps.model_state_dict`` leaves it out (a declared 10^12-row
        table tried to allocate 64 TB): its rows are in the checkpoints, and ``paramserver
        export --snapshot`` serves it.

        Raises:
            ConfigError: this server is one shard of several (it holds a part of the model;
                ``ps.model_state_dict(every shard's address, model)`` reads them all, and
                ``paramserver export`` builds it from every shard's checkpoint).
        """
        if self.config.shards > 1:
            raise ConfigError(
                f"Shard {self.config.shard} of {self.config.shards} holds a part "
                "of the model; read every shard with ps.model_state_dict(addresses, model), "
                "or paramserver export from their checkpoints."
            )
        c = self.coordinator
        weights, tables = c.checkpoint_state(whole=True)
        layouts = c.tables.layouts() if c.tables is not None else {}
        state = {
            **layout.state_dict(c.manifest, weights),
            **c.frozen,
            **whole_tables(layouts, [tables or {}], where="the state dict"),
        }
        return models.with_aliases(state, self.aliases)

    def status(self) -> dict[str, Any]:
        """The same figures as the Status RPC, as a dict."""
        return self.coordinator.status().as_dict()

    def wait_for_version(self, version: int, timeout: float) -> bool:
        """Block until ``version`` optimizer steps have been applied; False on timeout."""
        return self.coordinator.wait_for(lambda c: c.store.version >= version, timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops; True if it did within ``timeout``."""
        return self._stopped.wait(timeout)

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving (calls in flight get ``grace`` seconds), then write a last checkpoint."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        done = self._grpc.stop(grace)
        if self.data is not None:
            self.data.close()
        self.doorbell.close()  # and wakes pulls blocked on a barrier so they see the end
        done.wait()
        self._servicer.steps.close()  # the optimizer's thread, where it has one
        if self.checkpointer is not None:
            self.checkpointer.stop()
        self.shared.close()
        self.metrics.stop()
        log.info("server on %s stopped at version %d", self.address, self.coordinator.store.version)

    def read_rows(self, request: pb.RowsRequest) -> pb.RowsResponse:
        """A row pull answered in process, as an observer's over gRPC is (the server's own
        evaluation reads its tables so)."""
        return self._servicer.steps.pull_rows(request)

    def __enter__(self) -> ServerApp:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
