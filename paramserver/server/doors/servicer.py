"""gRPC servicer: decode -> coordinator -> encode. No decisions here."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from paramserver._proto import paramserver_pb2 as pb
from paramserver._proto import paramserver_pb2_grpc as pb_grpc
from paramserver.codec import wire
from paramserver.errors import OutOfOrder, ParamServerError, to_status
from paramserver.server.doors.dataport import DataPort
from paramserver.server.doors.payloads import Payloads
from paramserver.server.doors.steps import Steps
from paramserver.server.engine.coordinator import Coordinator
from paramserver.transport.attachments import Attachments

log = logging.getLogger(__name__)
NORM_WAIT = 10.0  # seconds a StepNorm waits for its round to close, at most (it is asked again)
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
    """Maps the RPCs of the wire contract onto a Coordinator; a step's push and pull go
    through ``Steps`` (payloads of workers on this host through their shared-memory
    segments, the others' through the codec). ``control``: the same-host control socket's
    name, offered to workers whose segment was mapped."""

    def __init__(
        self,
        coordinator: Coordinator,
        shared: Attachments,
        rewind: Callable[[int, str, str], bool] | None = None,
        control: str = "",
    ):
        self.c = coordinator
        self.shared = shared
        self.steps = Steps(coordinator, Payloads(shared, coordinator.manifest.np_dtype))
        self.rewind = rewind
        self.control = control
        self.data: DataPort | None = None  # the data port, once it serves

    @_rpc
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        member = self.c.join(
            request.name or context.peer(),
            request.worker_id,
            request.train_samples,
            request.join_id,
            list(request.past_ids),
        )
        shm = self.shared.attach(
            member.worker_id,
            request.shm_name,
            request.shm_nonce,
            request.shm_slots,
            request.shm_rows_bytes,
        )
        cfg = self.c.config
        return pb.JoinResponse(
            worker_id=member.worker_id,
            rank=member.rank,
            clock=member.clock,
            manifest=self.steps.manifest(),
            plan=pb.TrainingPlan(
                model=cfg.model,
                dataset=cfg.dataset,
                batch_size=cfg.batch_size,
                epochs=cfg.epochs,
                seed=cfg.seed,
                world_size=cfg.workers,
                loss=cfg.loss,
            ),
            policy=self.c.policy.name,
            lease_seconds=cfg.lease_seconds,
            chunk_bytes=cfg.chunk_bytes,
            incarnation=self.c.incarnation,
            origin=self.c.origin,
            shm=shm,
            shm_control=self.control if shm else "",
            data_port=self.data.port if self.data and not shm else 0,
            data_nonce=self.data.issue(member.worker_id) if self.data and not shm else b"",
            shard=cfg.shard,
            shards=cfg.shards,
            model_numel=self.c.model_numel,
            shard_offset=self.c.shard_offset,
            relay_norm=cfg.round_clip(self.c.tables is not None)[1],
            push_norm=cfg.push_norm(self.c.tables is not None),
        )

    def _pull(
        self, request: pb.PullRequest, context: grpc.ServicerContext
    ) -> tuple[pb.PullHeader, memoryview]:
        context.add_callback(self.c.notify)  # a pull waiting for the policy ends with its call
        return self.steps.pull(request, context.time_remaining(), context.is_active)

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
        return self.steps.push(wire.decode_push_header(request_iterator), request_iterator)

    @_rpc
    def PushPull(
        self, request: pb.PushPullRequest, context: grpc.ServicerContext
    ) -> pb.PushPullResponse:
        context.add_callback(self.c.notify)
        return self.steps.push_pull(request, context.time_remaining(), context.is_active)

    @_rpc
    def PullRows(self, request: pb.RowsRequest, context: grpc.ServicerContext) -> pb.RowsResponse:
        return self.steps.pull_rows(request)

    @_rpc
    def Rewind(self, request: pb.RewindRequest, context: grpc.ServicerContext) -> pb.RewindResponse:
        if self.rewind is None:
            raise OutOfOrder(
                "This server keeps no consistent cuts to rewind to: a sharded run needs "
                "--checkpoint-dir on every shard."
            )
        log.warning("worker %s asks to rewind to round %d", request.worker_id, request.round)
        self.rewind(request.round, request.incarnation, request.cause)
        return pb.RewindResponse(version=self.c.store.version, incarnation=self.c.incarnation)

    @_rpc
    def StepNorm(
        self, request: pb.StepNormRequest, context: grpc.ServicerContext
    ) -> pb.StepNormResponse:
        total = request.total if request.has_total else None
        wait = min(context.time_remaining() or NORM_WAIT, NORM_WAIT)
        closing, part, applied, (last, last_total) = self.c.step_norm(
            request.worker_id, request.incarnation, request.round, total, wait
        )
        return pb.StepNormResponse(
            part=part, closed=closing >= 0, applied=applied, round=closing,
            last_round=last, last_total=last_total,
        )  # fmt: skip

    @_rpc
    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        self.c.check_incarnation(request.incarnation)
        return pb.HeartbeatResponse(version=self.c.heartbeat(request.worker_id))

    @_rpc
    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        if self.c.leave(
            request.worker_id, request.finished, request.incarnation, request.returning
        ):
            self.shared.detach(request.worker_id)
        return pb.LeaveResponse()

    @_rpc
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return self.c.status().to_proto()
