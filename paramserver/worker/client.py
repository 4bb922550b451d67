"""The worker's side of the wire: join, pull, push (in the background), heartbeat, leave.

``Worker`` is also the public API for a user's own training loop::

    worker = paramserver.Worker("127.0.0.1:50051", model)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        worker.step()
    worker.close()
"""

from __future__ import annotations

import logging
import math
import os
import queue
import socket
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import torch
from torch import nn

from paramserver import codec, models
from paramserver._proto import paramserver_pb2 as pb
from paramserver._proto import paramserver_pb2_grpc as pb_grpc
from paramserver.errors import ConfigError, ParamServerError, ServerUnavailable, from_rpc_error
from paramserver.staleness import Policy

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


def connect(address: str, timeout: float) -> grpc.Channel:
    """A channel to ``address`` that is known to be connected.

    Raises:
        ServerUnavailable: nothing answers at ``address`` within ``timeout`` seconds.
    """
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        raise ServerUnavailable(
            f"No parameter server answered at {address} within {timeout:.0f}s: is it running, "
            "and is the address right?"
        ) from None
    return channel


def _sync(device: torch.device) -> None:
    """Wait for non-blocking copies to or from ``device`` to land."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Worker:
    """A member of a parameter-server run, wrapped around a local model.

    Joining loads the server's weights into ``model``. Each ``step()`` pushes the
    gradients in ``model``'s ``.grad`` fields (in the background as far as the policy
    allows) and loads the weights for the next iteration.

    Args:
        address: the server's host:port.
        model: the local replica; its parameters must match the server's manifest. None:
            build the model the server names.
        device: where to build the model when ``model`` is None (default: cpu).
        name: shown in the server's status; defaults to host:pid.
        rpc_timeout: deadline of Join, Push, Heartbeat and Leave, in seconds.
        barrier_timeout: how long a pull may wait for slower workers before it fails.
        connect_timeout: how long to wait for the server to answer at all.
        overlap: push in the background while the next step computes (as far as the policy
            allows), instead of waiting for the push before pulling. None: on for CUDA
            models, off on CPU, where compute and communication share the same cores and
            waiting lets each worker read its own last update (measured: same throughput,
            about 1.5 points better test accuracy after one epoch of Fashion-MNIST).
    """

    def __init__(
        self,
        address: str,
        model: nn.Module | None = None,
        *,
        device: str | torch.device | None = None,
        name: str | None = None,
        rpc_timeout: float = 60.0,
        barrier_timeout: float = 900.0,
        connect_timeout: float = 30.0,
        overlap: bool | None = None,
    ):
        self.address = address
        self.rpc_timeout = rpc_timeout
        self.barrier_timeout = barrier_timeout
        self._channel = connect(address, connect_timeout)
        self._stub = pb_grpc.ParameterServerStub(self._channel)
        self._closed = False
        reply = self._call(
            "join",
            self._stub.Join,
            pb.JoinRequest(name=name or f"{socket.gethostname()}:{os.getpid()}"),
        )
        self.worker_id: str = reply.worker_id
        self.rank: int = reply.rank
        self.clock: int = reply.clock
        self.plan: pb.TrainingPlan = reply.plan
        self.policy = Policy.parse(reply.policy)
        self.lease_seconds: float = reply.lease_seconds
        self.chunk_bytes: int = reply.chunk_bytes
        self.incarnation: str = reply.incarnation
        self.manifest = codec.Manifest.from_proto(reply.manifest)
        try:
            if model is None:
                if not self.plan.model:
                    raise ConfigError(
                        "The server holds a user-supplied model, so the worker cannot build it: "
                        "pass the model to Worker(address, model)."
                    )
                model = models.build(self.plan.model).to(device or "cpu")
            self.manifest.check_compatible(
                codec.Manifest.from_tensors(models.parameters(model)), "the local model"
            )
        except ParamServerError:
            self._leave_quietly()
            raise
        self.model = model
        self._params = [p for _, p in models.parameters(model)]
        self.device = self._params[0].device if self._params else torch.device("cpu")
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.version = 0
        self.last_staleness = 0
        pinned = self.device.type == "cuda"
        n = self.manifest.numel
        # Host buffers: one to receive weights, a small pool for gradients in flight.
        self._recv = torch.empty(n, dtype=torch.float32, pin_memory=pinned)
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(self.policy.max_inflight_pushes()):
            self._free.put(torch.empty(n, dtype=torch.float32, pin_memory=pinned))
        self._pushes: queue.Queue[tuple[int, torch.Tensor, int, float] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._pusher = threading.Thread(target=self._push_loop, name="ps-push", daemon=True)
        self._beater = threading.Thread(
            target=self._heartbeat_loop, name="ps-heartbeat", daemon=True
        )
        self._pusher.start()
        self._beater.start()
        log.info(
            "joined %s as %s (rank %d of %d) at clock %d under %s; push overlap %s",
            address,
            self.worker_id,
            self.rank,
            self.plan.world_size,
            self.clock,
            self.policy.name,
            "on" if self.overlap else "off",
        )
        try:
            self.pull()
        except BaseException:
            self.close_quietly()
            raise

    # --- calls ------------------------------------------------------------------------

    def _call(self, what: str, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return method(request, timeout=timeout or self.rpc_timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err, f"{what} to {self.address}") from None

    def pull(self) -> None:
        """Load the weights for iteration ``clock`` into the model, waiting as the policy says."""
        self._raise_background_error()
        try:
            stream: Iterator[pb.PullChunk] = self._stub.Pull(
                pb.PullRequest(worker_id=self.worker_id, iteration=self.clock),
                timeout=self.barrier_timeout,
            )
            header, _ = codec.decode_pull(stream, self._recv.numpy(), self.manifest.total_bytes)
        except grpc.RpcError as err:
            raise from_rpc_error(
                err, f"pull of iteration {self.clock} from {self.address}"
            ) from None
        codec.unflatten_into(
            self.manifest, self._recv.to(self.device, non_blocking=True), self._params
        )
        _sync(self.device)
        self.version = header.version
        self.last_staleness = header.staleness

    def step(self, samples: int = 0, loss: float = math.nan, pull: bool = True) -> None:
        """Push the model's gradients for this iteration, then pull the next weights.

        Gradients are zeroed afterwards. Parameters without a gradient push zeros.

        Args:
            samples: samples in this batch (for the server's throughput figures).
            loss: this batch's training loss (for monitoring).
            pull: False for a worker's last step: push only.

        Raises:
            ParamServerError: this or an earlier background push failed.
        """
        self._raise_background_error()
        buf = self._free.get()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        codec.flatten_into(self.manifest, grads, buf)
        _sync(self.device)
        self._pushes.put((self.clock, buf, samples, float(loss)))
        self.clock += 1
        for p in self._params:
            p.grad = None
        if not self.overlap:
            self.flush()
        if pull:
            self.pull()

    def _push_loop(self) -> None:
        while True:
            item = self._pushes.get()
            if item is None:
                return
            iteration, buf, samples, loss = item
            try:
                if self._error is None:
                    header = pb.PushHeader(
                        worker_id=self.worker_id, iteration=iteration, samples=samples, loss=loss
                    )
                    chunks = codec.encode_push(
                        header, codec.as_bytes(buf.numpy()), self.chunk_bytes
                    )
                    self._call(f"push of iteration {iteration}", self._stub.Push, chunks)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                self._error = exc
            finally:
                self._free.put(buf)
                self._pushes.task_done()

    def _heartbeat_loop(self) -> None:
        interval = max(self.lease_seconds / 3, 0.05)
        while not self._stop.wait(interval):
            try:
                self._call(
                    "heartbeat",
                    self._stub.Heartbeat,
                    pb.HeartbeatRequest(worker_id=self.worker_id),
                    timeout=interval * 2,
                )
            except ParamServerError as exc:
                log.warning("%s", exc)

    def _raise_background_error(self) -> None:
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """Wait until every push handed to the background has been answered."""
        self._pushes.join()
        self._raise_background_error()

    def status(self) -> pb.StatusResponse:
        """The server's Status."""
        return self._call("status", self._stub.Status, pb.StatusRequest())

    # --- leaving ----------------------------------------------------------------------

    def _leave_quietly(self) -> None:
        try:
            self._call(
                "leave", self._stub.Leave, pb.LeaveRequest(worker_id=self.worker_id), timeout=5
            )
        except ParamServerError as exc:
            log.warning("%s", exc)
        finally:
            self._channel.close()
            self._closed = True

    def close(self) -> None:
        """Finish pending pushes, leave the run and close the connection."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._stop.set()
            self._pushes.put(None)
            self._pusher.join(timeout=self.rpc_timeout)
            self._beater.join(timeout=self.rpc_timeout)
            self._leave_quietly()

    def close_quietly(self) -> None:
        """Leave after a failure, without waiting on pushes that may never finish."""
        if self._closed:
            return
        self._stop.set()
        self._pushes.put(None)
        self._leave_quietly()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def observe(
    channel: grpc.Channel, total_bytes: int, timeout: float = 60.0
) -> tuple[pb.PullHeader, np.ndarray]:
    """The server's current weights without joining the run (for evaluation and checkpoints)."""
    stub = pb_grpc.ParameterServerStub(channel)
    try:
        return codec.decode_pull(stub.Pull(pb.PullRequest(), timeout=timeout), None, total_bytes)
    except grpc.RpcError as err:
        raise from_rpc_error(err, "observer pull") from None
