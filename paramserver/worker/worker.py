"""``Worker``: a member of a parameter-server run, wrapped around a local model.

It is also the public API for a user's own training loop::

    worker = paramserver.Worker("127.0.0.1:50051", model)        # or every shard's address
    for x, y in loader:
        loss_fn(model(x), y).backward()
        worker.step()
    worker.close()

One session per server shard (``session``), each owning its channel (``transport/client.py``),
joined with a payload path over the shard's range of the model's flat buffer (``joining``,
``attach``). A step runs the ``stages``: it stages the gradients once into every range (one
copy), exchanges them for the next weights as its step mode says (``pipeline``), and loads
every range's weights into the model (one copy; none for blocking steps through shared
memory, where the model's tensors live in the segments: ``Replica.bind``).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression
from paramserver.config import Security
from paramserver.errors import ParamServerError, RejoinRequired
from paramserver.sparse.embedding import DEFAULT_CACHE_ROWS
from paramserver.transport import shm as shmem
from paramserver.transport.client import ChannelFactory, grpc_channels
from paramserver.worker import joining, stages
from paramserver.worker.pipeline import Pipeline
from paramserver.worker.rows import IdsByTable
from paramserver.worker.session import Heartbeats, Session
from paramserver.worker.shards import addresses_of, align_clocks, rewound
from paramserver.worker.stages import Stager
from paramserver.worker.view import WorkerView
from paramserver.worker.waits import Backoff

log = logging.getLogger(__name__)


class Worker(WorkerView):
    """A member of a parameter-server run, wrapped around a local model.

    Joining loads the servers' weights into ``model`` and makes its sparse embeddings the
    servers' tables (``tables``, ``worker/rows.py``: rows fetched on demand, or ahead with
    ``prefetch``). Each ``step()`` pushes the gradients
    in ``model``'s ``.grad`` fields and the rows touched (in the background as far as the
    policy allows) and loads the weights for the next iteration.

    Args:
        address: the server's host:port, or every shard's in shard order (a list, or
            "A,B,..."), when the parameters are split over servers (``--shard I/S``).
        model: the local replica; its parameters must match the servers' manifest. None:
            build the model the servers name.
        device: where to build the model when ``model`` is None (default: cpu).
        name: shown in the servers' status; defaults to host:pid.
        rpc_timeout: deadline of Join, Push, Heartbeat and Leave, in seconds.
        barrier_timeout: how long a pull may wait for slower workers before it fails.
        connect_timeout: how long to wait for a server to answer at all when joining.
        server_timeout: once joined, how long to keep retrying (capped exponential backoff
            with jitter) while a server is unreachable, e.g. restarting; then fail.
        security: TLS files and token (default: plain text, no token).
        train_samples: the size of the data set the worker trains on, when the server hands
            out its batches (``batch`` after each pull), or a function of the server's
            plan that loads the data and returns its size; 0 (default): the caller brings
            its own data and ignores batches.
        overlap: push in the background while the next step computes (as far as the policy
            allows), instead of waiting for the push before pulling. None: on for CUDA
            models, off on CPU (``docs/api.md`` says why).
        shm: offer each server a shared-memory segment for the payloads, used if it shares
            this host's /dev/shm, else payloads go as ``wire`` says (``shm_active``). ``shm_control``:
            with shared memory, carry each step's control over the server's same-host
            control socket instead of a gRPC call (``control_active`` says if it does).
        wire: how payloads reach a server that does not share the segment: "auto"
            (default) over its data port (raw TCP frames, with the same TLS and token) when
            it offers one, else gRPC streams; "grpc": gRPC streams always.
            ``data_port_active`` says if every shard's payloads take the data port.
        compress: "auto" (default: a float16/bfloat16 model's own dtype, else none),
            "none", "fp16" or "bf16": pushes and pulls in 16 bits (pushes with error
            feedback, buffers whole; the server keeps float32 masters). "int8": pushes as
            int8, a float32 scale per 1024 elements, pulls in bf16. "topk:F" (optionally
            ":fp16" or ":bf16" after it): each push sends the largest fraction F of its
            gradient's entries as (index, value) pairs, the rest kept per shard for the
            next push; pulls stay dense. int8 and top-k keep their error for the next push
            (dropped with a log line on a rejoin); ``docs/api.md`` says more.
        push_every: with the server's batches, how many to compute (accumulating their
            gradients) per push: ``batches`` after each pull lists them. Fewer round trips
            per sample, and K times the batch per optimizer step.
        cache_rows: the most rows each sparse table keeps on this worker.
        flat: keep the model's parameters, gradients and buffers as views of a few flat
            tensors on its device (``worker/flat.py``): a push is one copy a shard range,
            gradients leave a GPU in buckets during backward, and are zeroed in place.
            None (default): on for a model on a GPU, off on CPU.
        transport: makes the gRPC stub for an address (default: a ``Stub`` on a channel with
            ``security``, connected within ``connect_timeout``); the worker's channels are
            ``GrpcChannel``s on them.
        channel: makes the ``Channel`` (``paramserver.transport.client``) to an address,
            instead of ``transport``; each session owns and closes its own. Tests pass
            in-process ones.
        clock, sleep: the monotonic clock and the wait between retries (tests pass fakes).
    """

    batch: int | None  # the batch to compute next, when the server hands them out
    batches: list[int]  # all of them, with push_every > 1
    next_batches: list[int]  # the next step's, when the pulls ask ahead (``prefetch_next``)
    finished: bool  # the server has applied every batch of the run

    def __init__(
        self,
        address: str | Sequence[str],
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
        shm_control: bool = True,
        wire: str = "auto",
        compress: str = compression.AUTO,
        push_every: int = 1,
        cache_rows: int = DEFAULT_CACHE_ROWS,
        flat: bool | None = None,
        transport: Callable[[str], Any] | None = None,
        channel: ChannelFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], bool] | None = None,
    ):
        self.addresses = addresses_of(address)
        seconds = {"rpc_timeout": rpc_timeout, "barrier_timeout": barrier_timeout}
        seconds.update(connect_timeout=connect_timeout, server_timeout=server_timeout)
        joining.check(push_every, compress, wire, **seconds)
        self.address, self.push_every = ",".join(self.addresses), push_every
        self.compress = compress
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.shm, self.shm_control = shm and shmem.available(), shm_control
        self.wire = wire
        self._stop, self._closed, self._drop_step = threading.Event(), False, False
        self.version, self.last_staleness, self.finished = 0, 0, False
        self.batch, self.batches, self.next_batches = None, [], []
        channels = channel or grpc_channels(connect_timeout, security, transport)
        backoff = Backoff(server_timeout, now=clock)
        self.flat = flat
        self._join(channels, backoff, sleep, model, device, train_samples, rpc_timeout, cache_rows)
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self._start(rpc_timeout, barrier_timeout)

    # --- joining ----------------------------------------------------------------------

    def _join(
        self,
        channels: ChannelFactory,
        backoff: Backoff,
        sleep: Callable[[float], bool] | None,
        model: nn.Module | None,
        device: str | torch.device | None,
        train_samples: int | Callable[[pb.TrainingPlan], int],
        rpc_timeout: float,
        cache_rows: int,
    ) -> None:
        """A session per shard, all joined (``joining``); if any of it fails, every session
        opened is closed."""
        self.sessions: list[Session] = []
        try:
            for a in self.addresses:
                s = Session(channels, a, self.name, rpc_timeout, backoff, self._stop, sleep)
                self.sessions.append(s)
            # from each join on: building the model and loading the data may outlast a lease
            self._heartbeats = Heartbeats(self.sessions, self._stop).start()
            joined = joining.join(
                self.sessions,
                model,
                device,
                train_samples,
                rpc_timeout=rpc_timeout,
                cache_rows=cache_rows,
                rejoin=self._rejoin_mid_step,
                compress=self.compress,
                shm=self.shm,
                shm_control=self.shm_control,
                remote=self.wire != "grpc",
                flat=self.flat,
            )
        except BaseException:
            self._close_sessions()
            raise
        self.plan, self.policy, self.model = joined.plan, joined.policy, joined.model
        self.tables, self._replica, self._codec = joined.tables, joined.replica, joined.codec
        self.device, self.manifest = self._replica.device, self._replica.manifest
        self.ranges, self.train_samples = joined.ranges, joined.train_samples
        self._slots, self._attacher = joined.slots, joined.attacher
        self.tables.exact = self.policy.synchronous  # sync: rows exact, step for step

    def _start(self, rpc_timeout: float, barrier_timeout: float) -> None:
        """The stages, then the first pull; a failure closes the sessions (no ghost)."""
        try:
            sessions, ranges = self.sessions, self.ranges
            pipe = self._pipe = Pipeline(sessions, self._slots, rpc_timeout, barrier_timeout)
            self._stager = Stager(sessions, ranges, self._replica, self.tables, pipe, self._codec)
            self._loader = stages.loader(self.mode, self._replica, sessions, ranges)
            self._reopened()
        except BaseException:
            self._close_sessions()
            raise
        log.info(
            "joined %s as %s (rank %d of %d) at clock %d under %s; steps %s; payloads %s",
            self.address,
            self.worker_id,
            self.rank,
            self.plan.world_size,
            self.clock,
            self.policy.name,
            self.mode.value,
            self.sessions[0].channel.description,
        )
        try:
            self.pull()
        except BaseException:
            self.close_quietly()
            raise

    def _reopened(self) -> None:
        """The payload paths opened (again): bind the model to them, pick the exchange."""
        self._loader.reopened()
        self._exchange = stages.exchange(self.mode, self._pipe, self.push_every)

    def _rejoin_mid_step(self) -> None:
        """A row pull met a restarted server: join again; ``step()`` drops this step."""
        self._rejoin_lost()
        self._drop_step = True

    def _rejoin_lost(self) -> None:
        """Join every lost session again, then align the clocks (``shards.align_clocks``)."""
        while True:
            self._attacher.rejoin_lost(settle=self.flush, reopened=self._reopened)
            align_clocks(self.sessions, self._pipe.push_empty)
            if not any(s.lost for s in self.sessions):
                return

    # --- steps ------------------------------------------------------------------------

    def _load(self, headers: list[pb.PullHeader]) -> None:
        """Take every range's pulled weights into the model, and shard 0's news."""
        self._loader.load()
        first = headers[0]
        self.version = first.version
        self.last_staleness = max(h.staleness for h in headers)
        self.batch = first.batch if first.batch >= 0 else None
        self.batches, self.next_batches = list(first.batches), list(first.next_batches)
        self.finished = first.finished
        common = min(h.cut_written for h in headers)  # every shard has it on disk
        for s in self.sessions:
            s.common_cut = common

    def pull(self) -> None:
        """Load the weights for iteration ``clock`` into the model, waiting as the policy says.

        Sets ``batch`` (the batch to compute, when the server hands them out) and
        ``finished``. If a server restarted or dropped this worker, joins it again first.
        """
        self._pipe.check()
        self._pipe.wait_ahead()  # a prefetch was for the next iteration, not this one
        while True:
            self._rejoin_lost()
            try:
                headers = self._pipe.pull(self.push_every)
                break
            except RejoinRequired:
                continue  # the session is marked lost: join it again
        self._load(headers)
        self._exchange.then(None)
        self._told_of_rewinds()

    def _told_of_rewinds(self) -> None:
        """Raise the steps a restart lost (``shards.rewound``) to a loop with its own data."""
        lost = rewound(self.sessions)
        if lost is not None and not self.train_samples:
            raise lost

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
            ServerRewound: a server restarted behind this worker's steps (its own data:
                ``train_samples`` 0); joined again, it goes on from the error's ``step``.
            ParamServerError: this or an earlier background push failed.
        """
        self._pipe.check()
        if self._drop_step:  # as when a push meets a restarted server: drop it, pull again
            self._drop_step = False
            self._stager.cancel()
            self._replica.zero_grad()
            self.tables.forget()
            self.pull()
            return
        ready = self._exchange.landed()
        staged = self._stager.stage(samples, float(loss), empty, self.batches)
        headers = self._exchange.send(staged, ready, pull)
        if headers is not None:
            self._load(headers)
            self._exchange.then(staged)
        elif pull:
            self.pull()
        if pull:
            self.tables.refetch(self.clock, self.policy.bound)
        self._told_of_rewinds()

    def prefetch(self, ids: IdsByTable, wait: bool = True) -> None:
        """Fetch the rows of ``ids`` (``{table: ids}``) for the next forward pass: now, or
        (``wait`` False) in the background, which the next ``step`` waits for; the policy's
        bound holds either way (``worker/rows.py``); the rest are fetched on demand."""
        self.tables.prefetch(ids) if wait else self.tables.prefetch_soon(ids)

    def prefetch_next(self, ids_of: Callable[[list[int]], IdsByTable | None]) -> None:
        """With overlap, not under sync: fetch the rows of the next step's batches (named by
        ``ids_of(batches)``) in the background while this step computes, once the weights
        for it have come (prefetching steps), or from shard 0's ``next_batches`` (asked for
        from now on). Otherwise nothing."""
        ahead = self.overlap and self.policy.bound != 0 and not self.prefetching
        self.sessions[0].ahead = ahead
        later = self.next_batches if ahead else []
        self.tables.prefetch_ahead(self._pipe.ahead_first(), ids_of, later)

    def flush(self) -> None:
        """Wait until every push handed to the background is answered (or dropped)."""
        self._pipe.flush()
        self._pipe.check()

    # --- leaving ----------------------------------------------------------------------

    def heartbeat_once(self) -> None:
        """One heartbeat to every server (the background loop's body)."""
        self._heartbeats.once()

    def _close_sessions(self) -> None:
        self._stop.set()
        self._closed = True
        for s in self.sessions:
            try:
                s.close(finished=self.finished)
            except ParamServerError as exc:  # leave is best effort
                log.warning("%s", exc)

    def close(self) -> None:
        """Finish pending pushes, leave the run and close the connections."""
        if self._closed:
            return
        try:
            self.flush()
            self._pipe.settle()  # the rounds pushed applied: their norms relayed (shards)
        finally:
            self._stop.set()
            self._heartbeats.join(timeout=60)
            self._pipe.shutdown(wait=False)
            self.tables.close()
            self._replica.detach()
            self._close_sessions()

    def close_quietly(self) -> None:
        """Leave after a failure, without waiting on pushes that may never finish."""
        if self._closed:
            return
        self._stop.set()
        self._pipe.shutdown(wait=False)
        self._close_sessions()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ShardedWorker = Worker  # one release of grace for the old class: Worker takes the list now
