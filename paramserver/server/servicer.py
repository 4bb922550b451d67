"""gRPC servicer: decode -> coordinator -> encode. No decisions here."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from paramserver._proto import paramserver_pb2 as pb
from paramserver._proto import paramserver_pb2_grpc as pb_grpc
from paramserver.codec import compression, wire
from paramserver.errors import InvalidRequest, OutOfOrder, ParamServerError, to_status
from paramserver.server.coordinator import Coordinator
from paramserver.server.payloads import Payloads
from paramserver.shm import Attachments

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


def _rpc(func: F) -> F:
    """Turn a ParamServerError into its gRPC status; log anything unexpected."""

    @functools.wraps(func)
    def wrapper(self: Servicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            result = func(self, request, context)
            if isinstance(result, Iterator):
                # Streams raise while they are consumed: materialise errors there too.
                return _guard_stream(result, context)
            return result
        except ParamServerError as exc:
            context.abort(*to_status(exc))
        except Exception:
            log.exception("%s failed", func.__name__)
            context.abort(
                grpc.StatusCode.INTERNAL, f"{func.__name__} failed on the server; see its log."
            )

    return wrapper  # type: ignore[return-value]


def _guard_stream(stream: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    try:
        yield from stream
    except ParamServerError as exc:
        context.abort(*to_status(exc))


class Servicer(pb_grpc.ParameterServerServicer):
    """Maps the six RPCs of the wire contract onto a Coordinator (payloads of workers on
    this host through their shared-memory segments, the others' through the codec)."""

    def __init__(
        self,
        coordinator: Coordinator,
        shared: Attachments,
        rewind: Callable[[int, str], None] | None = None,
    ):
        self.c = coordinator
        self.shared = shared
        self.payloads = Payloads(shared, coordinator.manifest.np_dtype)
        self.rewind = rewind

    @_rpc
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        member = self.c.join(
            request.name or context.peer(), request.worker_id, request.train_samples
        )
        shm = self.shared.attach(
            member.worker_id, request.shm_name, request.shm_nonce, request.shm_slots
        )
        cfg = self.c.config
        return pb.JoinResponse(
            worker_id=member.worker_id,
            rank=member.rank,
            clock=member.clock,
            manifest=self.c.manifest.to_proto(),
            plan=pb.TrainingPlan(
                model=cfg.model,
                dataset=cfg.dataset,
                batch_size=cfg.batch_size,
                epochs=cfg.epochs,
                seed=cfg.seed,
                world_size=cfg.workers,
            ),
            policy=self.c.policy.name,
            lease_seconds=cfg.lease_seconds,
            chunk_bytes=cfg.chunk_bytes,
            incarnation=self.c.incarnation,
            shm=shm,
            shard=cfg.shard,
            shards=cfg.shards,
            model_numel=self.c.model_numel,
            shard_offset=self.c.shard_offset,
        )

    def _pull(
        self, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> tuple[pb.PullHeader, memoryview]:
        context.add_callback(self.c.notify)
        remaining = context.time_remaining()
        timeout = self.c.config.barrier_timeout
        if remaining is not None:
            timeout = min(timeout, remaining)
        self.c.check_incarnation(request.incarnation)
        result = self.c.pull(
            request.worker_id,
            request.iteration,
            timeout,
            context.is_active,
            request.batches or 1,
            request.incarnation,
        )
        header = pb.PullHeader(
            version=result.version,
            staleness=result.staleness,
            batch=result.batch,
            batches=result.batches,
            finished=result.finished,
        )
        return header, self.payloads.weights(request, header, result.weights)

    def _check_push_header(self, h: pb.PushHeader) -> None:
        """The header's own consistency: its shard, element type and byte count."""
        itemsize = compression.wire_itemsize(h.dtype)
        shard = self.c.config.shard
        if h.shard != shard:
            raise InvalidRequest(f"A push for shard {h.shard} reached shard {shard} of the server.")
        numel = self.c.manifest.numel
        expected = 0 if h.empty or h.shm else numel * itemsize
        if h.total_bytes != expected:
            why = (
                " (an empty push carries none)."
                if h.empty
                else " (a push through shared memory streams none)."
                if h.shm
                else "."
            )
            raise InvalidRequest(
                f"A push of {h.total_bytes} bytes does not match the model's "
                f"{numel * itemsize} bytes of {compression.wire_dtype(h.dtype)}{why}"
            )
        if h.iteration < 0:
            raise InvalidRequest(f"Iteration {h.iteration} is negative.")

    def _push(self, header: pb.PushHeader, rest: Iterator[pb.PushChunk]) -> pb.PushResponse:
        self.c.check_incarnation(header.incarnation)
        self._check_push_header(header)
        self.c.accept_header(header.worker_id)
        with self.payloads.gradient(header, rest) as grad:
            result = self.c.push(
                header.worker_id,
                header.iteration,
                grad,
                header.samples,
                header.loss,
                header.incarnation,
            )
        return pb.PushResponse(
            version=result.version, clock=result.clock, duplicate=result.duplicate
        )

    @_rpc
    def Pull(
        self, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PullChunk]:
        header, payload = self._pull(request, context)
        return wire.encode_pull(header, payload, self.c.config.chunk_bytes)

    @_rpc
    def Push(
        self, request_iterator: Iterator[pb.PushChunk], context: grpc.ServicerContext
    ) -> pb.PushResponse:
        return self._push(wire.decode_push_header(request_iterator), request_iterator)

    @_rpc
    def PushPull(
        self, request: pb.PushPullRequest, context: grpc.ServicerContext
    ) -> pb.PushPullResponse:
        asks_pull = request.HasField("pull")
        if not request.push.shm or (asks_pull and not request.pull.shm):
            raise InvalidRequest("PushPull carries its payloads in shared memory only.")
        push = self._push(request.push, iter(()))
        if not asks_pull:
            return pb.PushPullResponse(push=push)
        pull, _ = self._pull(request.pull, context)
        return pb.PushPullResponse(push=push, pull=pull)

    @_rpc
    def Rewind(self, request: pb.RewindRequest, context: grpc.ServicerContext) -> pb.RewindResponse:
        if self.rewind is None:
            raise OutOfOrder(
                "This server keeps no consistent cuts to rewind to: a sharded run needs "
                "--checkpoint-dir on every shard."
            )
        log.warning("worker %s asks to rewind to round %d", request.worker_id, request.round)
        self.rewind(request.round, request.incarnation)
        return pb.RewindResponse(version=self.c.store.version, incarnation=self.c.incarnation)

    @_rpc
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        self.c.check_incarnation(request.incarnation)
        return pb.HeartbeatResponse(version=self.c.heartbeat(request.worker_id))

    @_rpc
    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        self.c.leave(request.worker_id)
        self.shared.detach(request.worker_id)
        return pb.LeaveResponse()

    @_rpc
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return self.c.status().to_proto()
