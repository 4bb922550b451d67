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
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np
import torch
from torch import nn

from paramserver import models, security
from paramserver import shm as shmem
from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression, layout, wire
from paramserver.config import Security
from paramserver.errors import (
    ConfigError,
    ParamServerError,
    ServerUnavailable,
    UnknownWorker,
    WrongIncarnation,
    from_rpc_error,
)
from paramserver.staleness import Policy
from paramserver.stub import Stub

log = logging.getLogger(__name__)
T = TypeVar("T")

# Retries of a call that found no server: capped exponential backoff with full jitter.
BACKOFF_FIRST = 0.1
BACKOFF_CAP = 2.0
# Errors after which the worker joins again: the server restarted, or dropped its lease.
REJOIN = (WrongIncarnation, UnknownWorker)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


def connect(address: str, timeout: float, sec: Security | None = None) -> grpc.Channel:
    """A channel to ``address`` (with ``sec``'s TLS and token) that is known to be connected.

    Raises:
        ServerUnavailable: nothing answers at ``address`` within ``timeout`` seconds.
    """
    channel = security.client_channel(address, sec or Security(), CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        hint = (
            " With TLS: is the server's certificate signed by --tls-ca, and does the server "
            "accept this client's certificate?"
            if sec is not None and sec.tls
            else " If the server uses TLS, pass --tls-ca (and --tls-cert/--tls-key)."
        )
        raise ServerUnavailable(
            f"No parameter server answered at {address} within {timeout:g}s: is it running, "
            f"and is the address right?{hint}"
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
        connect_timeout: how long to wait for the server to answer at all when joining.
        server_timeout: once joined, how long to keep retrying (capped exponential backoff
            with jitter) while the server is unreachable, e.g. restarting; then fail.
        security: TLS files and token (default: plain text, no token).
        train_samples: the size of the data set the worker trains on, when the server hands
            out its batches (``batch`` after each pull), or a function of the server's
            plan that loads the data and returns its size; 0 (default): the caller brings
            its own data and ignores batches.
        overlap: push in the background while the next step computes (as far as the policy
            allows), instead of waiting for the push before pulling. None: on for CUDA
            models, off on CPU, where compute and communication share the same cores and
            waiting lets each worker read its own last update (measured: same throughput,
            about 1.5 points better test accuracy after one epoch of Fashion-MNIST).
        shm: offer the server a shared-memory segment for the payloads (see
            ``paramserver.shm``); used only if the server shares this host's /dev/shm,
            otherwise payloads stream over gRPC. ``shm_active`` says which.
        compress: "none", "fp16" or "bf16": the element type of gradients streamed over
            gRPC (halves their bytes; the server widens them to float32 and keeps float32
            weights). Pulls stay float32, and pushes through shared memory are not
            compressed.
        push_every: with the server's batches, how many to compute (accumulating their
            gradients) per push: ``batches`` after each pull lists them. Fewer round trips
            per sample, and K times the batch per optimizer step.
        shard: (I, S) when the server must be shard I of S (``ShardedWorker`` checks its
            servers' order this way, before the first pull).
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
        server_timeout: float = 300.0,
        security: Security | None = None,
        train_samples: int | Callable[[pb.TrainingPlan], int] = 0,
        shm: bool = True,
        compress: str = "none",
        push_every: int = 1,
        shard: tuple[int, int] | None = None,
    ):
        if not 1 <= push_every <= 1024:
            raise ConfigError(f"push_every must be 1 to 1024; got {push_every}.")
        self.push_every = push_every
        if compress not in compression.COMPRESSION:
            raise ConfigError(
                f"compress must be one of {', '.join(compression.COMPRESSION)}; got {compress!r}."
            )
        self.address = address
        self.rpc_timeout = rpc_timeout
        self.barrier_timeout = barrier_timeout
        self.server_timeout = server_timeout
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self._channel = connect(address, connect_timeout, security)
        self._stub = Stub(self._channel)
        self._closed = False
        self._stop = threading.Event()
        self._lost = threading.Event()  # the server restarted or dropped us: join again
        self.rejoins = 0
        self.worker_id = ""
        self.train_samples = 0 if callable(train_samples) else train_samples
        reply = self._call(
            "join",
            self._stub.Join,
            pb.JoinRequest(name=self.name, train_samples=self.train_samples),
        )
        self._adopt(reply)
        self.plan: pb.TrainingPlan = reply.plan
        self.policy = Policy.parse(reply.policy)
        self.chunk_bytes: int = reply.chunk_bytes
        self.manifest = layout.Manifest.from_proto(reply.manifest)
        self.shm = shm and shmem.available()
        self.compress = compress
        self._compressor = compression.by_name(compress)(self.manifest.numel)
        self._segment: shmem.Segment | None = None
        self._recv = torch.empty(0)
        self._slots: list[torch.Tensor] = []
        self.shard, self.shards = reply.shard, max(reply.shards, 1)
        try:
            if shard is not None and shard != (self.shard, self.shards):
                raise ConfigError(
                    f"The server at {address} is shard {self.shard} of {self.shards}, but it "
                    f"was given as shard {shard[0]} of {shard[1]}: list every shard's address "
                    "in shard order."
                )
            if self.shards > 1 and (
                model is None or [n for n, _ in models.parameters(model)] != ["flat"]
            ):
                raise ConfigError(
                    f"The server at {address} holds shard {self.shard} of {self.shards} of the "
                    "parameters: give the worker every shard's address, in order (--server "
                    "A,B,...; paramserver.ShardedWorker([A, B, ...]) in Python)."
                )
            if model is None:
                if not self.plan.model:
                    raise ConfigError(
                        "The server holds a user-supplied model, so the worker cannot build it: "
                        "pass the model to Worker(address, model)."
                    )
                model = models.build(self.plan.model).to(device or "cpu")
            self.manifest.check_compatible(
                layout.Manifest.from_tensors(models.parameters(model)), "the local model"
            )
            self.model = model
            self._params = [p for _, p in models.parameters(model)]
            self.device = self._params[0].device if self._params else torch.device("cpu")
            if callable(train_samples):
                self.train_samples = train_samples(reply.plan)
            if callable(train_samples) or self.shm:
                # Join again under the same id, now with the data's size and a segment.
                segment = self._new_segment()
                reply = self._call("join", self._stub.Join, self._join_request(segment))
                self._adopt(reply)
                self._use_buffers(segment, reply.shm)
            else:
                self._use_buffers(None, False)
        except BaseException:
            self._leave_quietly()
            raise
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        # Prefetch: a push and the pull after next in flight while the model computes.
        self._ahead: Future[pb.PullHeader] | None = None
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._ready: pb.PullHeader | None = None  # a prefetched pull, its weights in _recv
        self.version = 0
        self.last_staleness = 0
        self.batch: int | None = None  # the batch to compute next, when the server hands them out
        self.batches: list[int] = []  # all of them, with push_every > 1
        self.finished = False  # the server has applied every batch of the run
        # Push slots free to fill: indexes into self._slots.
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(len(self._slots)):
            self._free.put(i)
        self._pushes: queue.Queue[tuple[int, int, int, float, bool] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._pusher = threading.Thread(target=self._push_loop, name="ps-push", daemon=True)
        self._beater = threading.Thread(
            target=self._heartbeat_loop, name="ps-heartbeat", daemon=True
        )
        self._pusher.start()
        self._beater.start()
        log.info(
            "joined %s as %s (rank %d of %d) at clock %d under %s; push overlap %s; payloads %s",
            address,
            self.worker_id,
            self.rank,
            self.plan.world_size,
            self.clock,
            self.policy.name,
            "on" if self.overlap else "off",
            "in shared memory"
            if self.shm_active
            else f"streamed over gRPC (gradients in {self._compressor.dtype})",
        )
        try:
            self.pull()
        except BaseException:
            self.close_quietly()
            raise

    # --- buffers --------------------------------------------------------------------

    def _new_segment(self) -> shmem.Segment | None:
        """A fresh shared-memory segment to offer the server, or None if off or failing."""
        if not self.shm:
            return None
        try:
            return shmem.Segment(self.manifest.total_bytes, self.policy.max_inflight_pushes())
        except OSError as exc:
            log.warning("cannot create a shared-memory segment (%s); streaming over gRPC", exc)
            return None

    def _join_request(self, segment: shmem.Segment | None) -> pb.JoinRequest:
        request = pb.JoinRequest(
            name=self.name, worker_id=self.worker_id, train_samples=self.train_samples
        )
        if segment is not None:
            request.shm_name = segment.name
            request.shm_nonce = segment.nonce
            request.shm_slots = segment.nslots
        return request

    def _use_buffers(self, segment: shmem.Segment | None, mapped: bool) -> None:
        """Receive weights and stage pushes in ``segment`` if the server ``mapped`` it, else
        in private host memory (pinned for CUDA models). No push may be in flight."""
        if segment is not None:
            segment.unlink()  # the server holds its mapping, or declined: the name can go
            if not mapped:
                segment.close()
                segment = None
        had_private = self._segment is None and self._recv.numel() == self.manifest.numel
        if self._segment is not None:
            self._segment.close()
        self._segment = segment
        if segment is not None:
            self._recv = torch.from_numpy(segment.weights)
            self._slots = [torch.from_numpy(a) for a in segment.slots]
            return
        if not had_private:
            pinned = self.device.type == "cuda"
            n, k = self.manifest.numel, self.policy.max_inflight_pushes()
            self._recv = torch.empty(n, dtype=torch.float32, pin_memory=pinned)
            self._slots = [torch.empty(n, dtype=torch.float32, pin_memory=pinned) for _ in range(k)]

    @property
    def shm_active(self) -> bool:
        """Whether payloads go through a shared-memory segment the server mapped."""
        return self._segment is not None

    # --- calls ------------------------------------------------------------------------

    def _adopt(self, reply: pb.JoinResponse) -> None:
        self.worker_id = reply.worker_id
        self.rank = reply.rank
        self.clock = reply.clock
        self.incarnation = reply.incarnation
        self.lease_seconds = reply.lease_seconds

    def _call(self, what: str, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return method(request, timeout=timeout or self.rpc_timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err, f"{what} to {self.address}") from None

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, retried while the server is unreachable, for up to ``server_timeout``.

        Raises:
            ServerUnavailable: the server did not come back in time.
            ParamServerError: any other failure, at once.
        """
        attempt, since = 0, None
        while True:
            try:
                return call()
            except grpc.RpcError as err:
                exc = from_rpc_error(err, f"{what} to {self.address}")
            if not isinstance(exc, ServerUnavailable) or self._stop.is_set():
                raise exc
            now = time.monotonic()
            if since is None:
                since = now
                log.warning("%s; retrying for up to %.0fs", exc, self.server_timeout)
            if now - since >= self.server_timeout:
                raise ServerUnavailable(
                    f"The server at {self.address} did not come back within {self.server_timeout:.0f}s "
                    f"(--server-timeout); last error: {exc}"
                ) from None
            delay = random.uniform(0, min(BACKOFF_CAP, BACKOFF_FIRST * 2**attempt))
            attempt += 1
            if self._stop.wait(delay):
                raise exc

    def _rejoin(self) -> None:
        """Join again after the server restarted (or dropped our lease), keeping our id.

        Pushes not yet acknowledged are dropped: the server's clock for this worker says
        which of its pushes it holds, and the worker goes on from there.
        """
        self._pushes.join()  # the pusher drops what is queued while the server is lost
        self._raise_background_error()
        was = self.clock
        segment = self._new_segment()
        request = self._join_request(segment)
        try:
            reply = self._retrying(
                "rejoin", lambda: self._stub.Join(request, timeout=self.rpc_timeout)
            )
            layout.Manifest.from_proto(reply.manifest).check_compatible(
                self.manifest, "the model this worker trains"
            )
        except BaseException:
            if segment is not None:
                segment.close()
            raise
        old_id, old_incarnation = self.worker_id, self.incarnation
        self._adopt(reply)
        self._use_buffers(segment, reply.shm)
        self.rejoins += 1
        self._lost.clear()
        log.warning(
            "rejoined %s (incarnation %s, was %s) as %s (was %s) at clock %d (was %d)",
            self.address,
            self.incarnation,
            old_incarnation,
            self.worker_id,
            old_id,
            self.clock,
            was,
        )

    def _pull_request(self, iteration: int) -> pb.PullRequest:
        return pb.PullRequest(
            worker_id=self.worker_id,
            iteration=iteration,
            incarnation=self.incarnation,
            shm=self.shm_active,
            batches=self.push_every,
        )

    def _pull_once(self, iteration: int | None = None) -> pb.PullHeader:
        stream: Iterator[pb.PullChunk] = self._stub.Pull(
            self._pull_request(self.clock if iteration is None else iteration),
            timeout=self.barrier_timeout,
        )
        header, _ = wire.decode_pull(stream, self._recv.numpy(), self.manifest.total_bytes)
        return header

    def pull(self) -> None:
        """Load the weights for iteration ``clock`` into the model, waiting as the policy says.

        Sets ``batch`` (the batch to compute, when the server hands them out) and
        ``finished``. If the server restarted, joins it again first.
        """
        self._raise_background_error()
        self._wait_ahead()
        self._ready = None  # a prefetch was for the next iteration, not this one
        while True:
            if self._lost.is_set():
                self._rejoin()
            try:
                header = self._retrying(f"pull of iteration {self.clock}", self._pull_once)
                break
            except REJOIN as exc:
                log.warning("%s", exc)
                self._lost.set()
        self._load(header)
        self._start_ahead(None)

    # --- prefetch ---------------------------------------------------------------------

    @property
    def prefetching(self) -> bool:
        """Whether the next weights are fetched while the model computes: with overlap,
        payloads in shared memory, and a policy that lets a worker compute iteration t+1
        before its push of t has landed (every one but sync)."""
        return self.overlap and self.shm_active and not self.policy.synchronous

    def _start_ahead(self, item: tuple[int, int, int, float, bool] | None) -> None:
        """In the background: push ``item`` (if any), then pull iteration ``clock + 1``."""
        if item is None and not self.prefetching:  # with an item, _step_ahead checked it
            return
        after = self.clock + 1
        call: Callable[[], pb.PullHeader]
        if item is None:
            call = lambda: self._pull_once(after)  # noqa: E731
        else:
            call = self._push_and_pull(item, lambda: after)

        def run() -> pb.PullHeader:
            try:
                return self._retrying(f"prefetch of iteration {after}", call)
            finally:
                if item is not None:
                    self._free.put(item[1])

        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="ps-ahead")
        self._ahead = self._ahead_pool.submit(run)

    def _wait_ahead(self) -> None:
        """Let the call in flight land: its header goes to ``_ready`` (weights in ``_recv``).

        Raises:
            ParamServerError: it failed (not for a lost server: that sets ``_lost``).
        """
        future, self._ahead = self._ahead, None
        if future is None:
            return
        try:
            self._ready = future.result()
        except REJOIN as exc:
            log.warning("%s; the push in flight is dropped, joining again", exc)
            self._lost.set()

    def _stage(self, samples: int, loss: float, empty: bool) -> tuple[int, int, int, float, bool]:
        """Copy the gradients into a free push slot, zero them and advance the clock; returns
        the push to send: (iteration, slot, samples, loss, empty)."""
        slot = self._free.get()
        if not empty:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
            layout.flatten_into(self.manifest, grads, self._slots[slot])
            _sync(self.device)
        item = (self.clock, slot, samples, float(loss), empty)
        self.clock += 1
        for p in self._params:
            p.grad = None
        return item

    def _step_ahead(self, samples: int, loss: float, pull: bool, empty: bool) -> None:
        """``step`` when prefetching: the weights for the next iteration are (being) fetched
        already; take them, then push this gradient and prefetch the one after."""
        self._wait_ahead()
        header, self._ready = self._ready, None
        item = self._stage(samples, loss, empty)
        if self._lost.is_set():  # the server restarted: it goes on from the clock it holds
            self._free.put(item[1])
            if pull:
                self.pull()
            return
        if header is None or not pull:  # nothing prefetched, or the last step
            self._pushes.put(item)
            self.flush()
            if pull:
                self.pull()
            return
        self._load(header)
        self._start_ahead(item)

    def _load(self, header: pb.PullHeader) -> None:
        """Take the pulled weights (in ``_recv``) into the model, and the header's news."""
        layout.unflatten_into(
            self.manifest, self._recv.to(self.device, non_blocking=True), self._params
        )
        _sync(self.device)
        self.version = header.version
        self.last_staleness = header.staleness
        self.batch = header.batch if header.batch >= 0 else None
        self.batches = list(header.batches)
        self.finished = header.finished

    def _push_header(
        self, iteration: int, slot: int, samples: int, loss: float, empty: bool
    ) -> pb.PushHeader:
        return pb.PushHeader(
            worker_id=self.worker_id,
            iteration=iteration,
            samples=samples,
            loss=loss,
            incarnation=self.incarnation,
            empty=empty,
            shm=self.shm_active,
            shm_slot=slot,
            shard=self.shard,
        )

    def _sender(self, header: pb.PushHeader, slot: int) -> Callable[[], Any]:
        """A call that sends one push: a unary call when the gradient is in the segment,
        else a stream of the header and the payload's chunks."""
        if self.shm_active:
            request = pb.PushPullRequest(push=header)
            return lambda: self._stub.PushPull(request, timeout=self.rpc_timeout)
        payload = memoryview(b"")
        if not header.empty:
            payload = self._compressor.encode(self._slots[slot])
            header.dtype = self._compressor.dtype
        return lambda: self._stub.Push(
            wire.encode_push(header, payload, self.chunk_bytes), timeout=self.rpc_timeout
        )

    def _push_and_pull(
        self, item: tuple[int, int, int, float, bool], pull_iteration: Callable[[], int]
    ) -> Callable[[], pb.PullHeader]:
        """A PushPull call that pushes ``item`` and pulls ``pull_iteration()`` (read at each
        try); both payloads are in the segment."""
        request = pb.PushPullRequest(push=self._push_header(*item))

        def call() -> pb.PullHeader:
            request.pull.CopyFrom(self._pull_request(pull_iteration()))
            reply: pb.PushPullResponse = self._stub.PushPull(request, timeout=self.barrier_timeout)
            return reply.pull

        return call

    def _push_pull(self, item: tuple[int, int, int, float, bool]) -> None:
        """Push ``item`` and pull the next weights in one round trip (payloads in the
        segment). After a server restart the push is dropped and the pull joins again."""
        iteration, slot = item[0], item[1]
        call = self._push_and_pull(item, lambda: self.clock)
        try:
            header = self._retrying(f"push of iteration {iteration} and pull", call)
        except REJOIN as exc:
            log.warning("%s; push of iteration %d dropped, joining again", exc, iteration)
            self._lost.set()
            self.pull()
            return
        finally:
            self._free.put(slot)
        self._load(header)

    def step(
        self, samples: int = 0, loss: float = math.nan, pull: bool = True, empty: bool = False
    ) -> None:
        """Push the model's gradients for this iteration, then pull the next weights.

        Gradients are zeroed afterwards. Parameters without a gradient push zeros.

        Args:
            samples: samples in this batch (for the server's throughput figures).
            loss: this batch's training loss (for monitoring).
            pull: False for a worker's last step: push only.
            empty: push no gradient (a sync worker that got no batch this round).

        Raises:
            ParamServerError: this or an earlier background push failed.
        """
        self._raise_background_error()
        if self.prefetching:
            self._step_ahead(samples, float(loss), pull, empty)
            return
        item = self._stage(samples, loss, empty)
        if pull and not self.overlap and self.shm_active:
            self._push_pull(item)
            return
        self._pushes.put(item)
        if not self.overlap:
            self.flush()
        if pull:
            self.pull()

    def _push_loop(self) -> None:
        while True:
            item = self._pushes.get()
            if item is None:
                return
            iteration, slot, samples, loss, empty = item
            try:
                if self._error is None and not self._lost.is_set():
                    header = self._push_header(iteration, slot, samples, loss, empty)
                    self._retrying(f"push of iteration {iteration}", self._sender(header, slot))
            except REJOIN as exc:
                log.warning("%s; push of iteration %d dropped, joining again", exc, iteration)
                self._lost.set()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                self._error = exc
            finally:
                self._free.put(slot)
                self._pushes.task_done()

    def _heartbeat_loop(self) -> None:
        interval = max(self.lease_seconds / 3, 0.05)
        while not self._stop.wait(interval):
            try:
                self._call(
                    "heartbeat",
                    self._stub.Heartbeat,
                    pb.HeartbeatRequest(worker_id=self.worker_id, incarnation=self.incarnation),
                    timeout=interval * 2,
                )
            except REJOIN as exc:
                log.warning("%s", exc)
                self._lost.set()
            except ParamServerError as exc:
                log.info("%s", exc)

    def _raise_background_error(self) -> None:
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """Wait until every push handed to the background has been answered.

        Pushes dropped because the server restarted are not answered: the next pull joins
        the new server and goes on from the clock it holds.
        """
        self._wait_ahead()
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
            if self._segment is not None:
                self._segment.close()

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
            if self._ahead_pool is not None:
                self._ahead_pool.shutdown(wait=False, cancel_futures=True)
            self._leave_quietly()

    def close_quietly(self) -> None:
        """Leave after a failure, without waiting on pushes that may never finish."""
        if self._closed:
            return
        self._stop.set()
        self._pushes.put(None)
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown(wait=False, cancel_futures=True)
        self._leave_quietly()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def observe(
    channel: grpc.Channel, total_bytes: int, timeout: float = 60.0
) -> tuple[pb.PullHeader, np.ndarray]:
    """The server's current weights without joining the run (for evaluation and checkpoints)."""
    stub = Stub(channel)
    try:
        return wire.decode_pull(stub.Pull(pb.PullRequest(), timeout=timeout), None, total_bytes)
    except grpc.RpcError as err:
        raise from_rpc_error(err, "observer pull") from None
