"""One exception tree for paramserver, and its one mapping to and from gRPC status codes.

``ParamServerError`` is the base of every error raised on purpose. ``RejoinRequired`` is the
base of those after which a worker joins its server again (the server restarted, or no
longer knows the worker): a worker catches that class, not a list. ``WIRE`` pairs each class
with its status code; a server reports an error with ``to_status`` and a client raises the
matching class with ``from_rpc_error``, both read from it."""

from __future__ import annotations

import grpc


class ParamServerError(Exception):
    """Base class of every error paramserver raises on purpose."""


class ConfigError(ParamServerError, ValueError):
    """A setting is invalid; the message names the setting and the bad value."""


class InvalidRequest(ParamServerError):
    """A request is malformed: wrong sizes, shapes, dtypes or fields."""


class RejoinRequired(ParamServerError):
    """The server does not know this worker as it is: join again, under the same id."""


class UnknownWorker(RejoinRequired):
    """The worker id is unknown to this server, or its lease has expired."""


class OutOfOrder(ParamServerError):
    """A push or pull names an iteration the worker's clock does not allow."""


class ClusterFull(ParamServerError):
    """The server already has as many live workers as it was started for."""


class ServerUnavailable(ParamServerError):
    """The server cannot be reached."""


class Timeout(ParamServerError):
    """A call or a barrier did not finish within its deadline."""


class WrongIncarnation(RejoinRequired):
    """The call names a server incarnation that is not this one: the server restarted."""


class ServerRewound(ParamServerError):
    """A server restarted from an older state than this worker had pushed to (a checkpoint
    behind its last steps, or a push in flight when it stopped): the worker joined it again,
    and ``Worker.step`` (or ``pull``) raises this once, so that a loop bringing its own data
    redoes it from ``step`` (the worker's ``clock``): ``lost`` steps are not in the model."""

    def __init__(self, message: str, step: int, lost: int):
        super().__init__(message)
        self.step, self.lost = step, lost


class Unauthenticated(ParamServerError):
    """The call carries no valid token."""


class DataUnavailable(ParamServerError):
    """A data set cannot be found or read."""


class BrokenSegment(InvalidRequest):
    """A worker's segment changed size since Join (truncated or grown) or cannot be read or
    written: the call is refused, and the server drops the worker (``server/doors/steps.py``; raised by ``paramserver.transport.shm``)."""

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
    segment the server declines from then on: its payloads go over gRPC (``server/doors/steps.py``)."""

    def __init__(self, worker_id: str, why: str):
        super().__init__(
            f"The server cannot use worker {worker_id}'s shared-memory segment ({why}); join "
            "again: its payloads go over gRPC from now on."
        )
        self.worker_id = worker_id


# The one mapping. A class not listed takes its nearest listed base's code; a code maps back
# to the first class listed with it.
WIRE: tuple[tuple[type[ParamServerError], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownWorker, grpc.StatusCode.NOT_FOUND),
    (OutOfOrder, grpc.StatusCode.FAILED_PRECONDITION),
    (DataUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
    (ClusterFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ServerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (Timeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (WrongIncarnation, grpc.StatusCode.ABORTED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (ParamServerError, grpc.StatusCode.INTERNAL),
)
_CODE_OF = dict(WIRE)
_CLASS_OF: dict[grpc.StatusCode, type[ParamServerError]] = {}
for _cls, _code in WIRE:
    _CLASS_OF.setdefault(_code, _cls)


def status_code(cls: type[ParamServerError]) -> grpc.StatusCode:
    """The status code a server answers an error of class ``cls`` with."""
    return next(_CODE_OF[base] for base in cls.__mro__ if base in _CODE_OF)


def to_status(exc: ParamServerError) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and details a server reports for ``exc``."""
    return status_code(type(exc)), str(exc)


def from_rpc_error(err: grpc.RpcError, what: str) -> ParamServerError:
    """Turn a failed call into the matching ParamServerError.

    Args:
        err: the error raised by a gRPC stub call.
        what: a few words naming the call, for the message ("push to 10.0.0.1:50051").
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _CLASS_OF.get(code, ParamServerError)
    return cls(f"{what} failed with {code.name}: {details}")
