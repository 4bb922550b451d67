"""The one error tree and its one mapping to gRPC, both directions; the handler helper the
interceptors share, for all four shapes."""

from __future__ import annotations

import grpc
import pytest

from paramserver import errors
from paramserver.transport.handlers import behavior_of, method_handler, wrap_handler


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _all_errors() -> list[type[errors.ParamServerError]]:
    found, todo = [], [errors.ParamServerError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c.__module__ == "paramserver.errors"]


@pytest.mark.parametrize("cls", _all_errors(), ids=lambda c: c.__name__)
def test_a_server_error_comes_back_as_the_class_of_its_code(cls: type) -> None:
    if cls in (errors.BrokenSegment, errors.SegmentUnusable):
        exc = cls("w1", "gone")
    else:
        exc = cls("x", 5, 2) if cls is errors.ServerRewound else cls("x")  # a worker's own
    code, details = errors.to_status(exc)
    back = errors.from_rpc_error(_Failed(code, details), "push to here")
    assert errors.status_code(type(back)) == code
    assert isinstance(back, errors.ParamServerError)
    assert details in str(back) and "push to here" in str(back)
    # the class back is the one listed first for the code, and an ancestor-or-peer of ``cls``
    assert isinstance(exc, type(back)) or errors.status_code(cls) == code


def test_the_errors_a_worker_rejoins_after_share_one_base() -> None:
    rejoin = {c for c in _all_errors() if issubclass(c, errors.RejoinRequired)}
    assert rejoin == {
        errors.RejoinRequired,
        errors.UnknownWorker,
        errors.WrongIncarnation,
        errors.SegmentUnusable,
    }
    for code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED):
        assert isinstance(errors.from_rpc_error(_Failed(code, ""), "x"), errors.RejoinRequired)
    not_rejoin = errors.from_rpc_error(_Failed(grpc.StatusCode.INVALID_ARGUMENT, ""), "x")
    assert not isinstance(not_rejoin, errors.RejoinRequired)


def test_a_code_no_class_claims_is_a_plain_paramserver_error() -> None:
    back = errors.from_rpc_error(_Failed(grpc.StatusCode.DATA_LOSS, "bits"), "x")
    assert type(back) is errors.ParamServerError
    assert errors.to_status(errors.ParamServerError("boom"))[0] == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("request_streaming", [False, True])
@pytest.mark.parametrize("response_streaming", [False, True])
def test_wrapping_keeps_a_handlers_shape(request_streaming: bool, response_streaming: bool) -> None:
    calls = []

    def answer(request: object, context: object) -> object:
        calls.append(request)
        return iter(["a", "b"]) if response_streaming else "a"

    handler = method_handler(
        answer,
        request_streaming=request_streaming,
        response_streaming=response_streaming,
        request_deserializer=bytes,
        response_serializer=str.encode,
    )

    def around(inner, streaming):  # type: ignore[no-untyped-def]
        assert streaming == response_streaming

        def wrapped(request, context):  # type: ignore[no-untyped-def]
            return inner(("seen", request), context)

        return wrapped

    wrapped = wrap_handler(handler, around)
    assert (wrapped.request_streaming, wrapped.response_streaming) == (
        request_streaming,
        response_streaming,
    )
    assert wrapped.request_deserializer is bytes
    assert wrapped.response_serializer is str.encode
    behavior_of(wrapped)("req", None)
    assert calls == [("seen", "req")]
