"""One exception tree for paramserver, and its mapping to and from gRPC status codes."""

from __future__ import annotations

import grpc


class ParamServerError(Exception):
    """Base class of every error paramserver raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class ConfigError(ParamServerError, ValueError):
    """A setting is invalid; the message names the setting and the bad value."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidRequest(ParamServerError):
    """A request is malformed: wrong sizes, shapes, dtypes or fields."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownWorker(ParamServerError):
    """The worker id is unknown to this server, or its lease has expired."""

    code = grpc.StatusCode.NOT_FOUND


class OutOfOrder(ParamServerError):
    """A push or pull names an iteration the worker's clock does not allow."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ClusterFull(ParamServerError):
    """The server already has as many live workers as it was started for."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ServerUnavailable(ParamServerError):
    """The server cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE


class Timeout(ParamServerError):
    """A call or a barrier did not finish within its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class WrongIncarnation(ParamServerError):
    """The call names a server incarnation that is not this one: the server restarted."""

    code = grpc.StatusCode.ABORTED


class Unauthenticated(ParamServerError):
    """The call carries no valid token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class DataUnavailable(ParamServerError):
    """A data set cannot be found or read."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class BrokenSegment(InvalidRequest):
    """A worker's segment changed size since Join (truncated or grown) or cannot be read or
    written: the call is refused, and the server drops the worker (``server/steps.py``; raised by ``paramserver.transport.shm``)."""

    def __init__(self, worker_id: str, why: str):
        super().__init__(
            f"Worker {worker_id}'s shared-memory segment {why}; the server dropped the worker "
            "and no longer uses its segment: join again."
        )
        self.worker_id = worker_id


class SegmentUnusable(UnknownWorker):
    """The server cannot read or write a worker's segment for a reason of its own (a full
    ``/dev/shm``, a file-size limit, an I/O error): it lets go of the segment, keeps the
    worker, and answers NOT_FOUND, so that the worker joins again under its id, offering a
    segment the server declines from then on: its payloads go over gRPC (``server/steps.py``)."""

    def __init__(self, worker_id: str, why: str):
        super().__init__(
            f"The server cannot use worker {worker_id}'s shared-memory segment ({why}); join "
            "again: its payloads go over gRPC from now on."
        )
        self.worker_id = worker_id


_BY_CODE: dict[grpc.StatusCode, type[ParamServerError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: UnknownWorker,
    grpc.StatusCode.FAILED_PRECONDITION: OutOfOrder,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ClusterFull,
    grpc.StatusCode.UNAVAILABLE: ServerUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Timeout,
    grpc.StatusCode.ABORTED: WrongIncarnation,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def to_status(exc: ParamServerError) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and details a server reports for ``exc``."""
    return exc.code, str(exc)


def from_rpc_error(err: grpc.RpcError, what: str) -> ParamServerError:
    """Turn a failed call into the matching ParamServerError.

    Args:
        err: the error raised by a gRPC stub call.
        what: a few words naming the call, for the message ("push to 10.0.0.1:50051").
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, ParamServerError)
    return cls(f"{what} failed with {code.name}: {details}")
