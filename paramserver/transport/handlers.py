"""gRPC method handlers of any of the four shapes (unary or stream request, unary or stream
response), made and wrapped in one place: the server's interceptors (the token's refusal,
the metrics' latency timer) build on these, not on a branch per shape each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behavior = Callable[[Any, grpc.ServicerContext], Any]

_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def method_handler(
    behavior: Behavior,
    *,
    request_streaming: bool,
    response_streaming: bool,
    request_deserializer: Any,
    response_serializer: Any,
) -> grpc.RpcMethodHandler:
    """A handler of the given shape around ``behavior(request_or_iterator, context)``."""
    make = _MAKERS[(request_streaming, response_streaming)]
    return make(  # type: ignore[no-any-return]
        behavior,
        request_deserializer=request_deserializer,
        response_serializer=response_serializer,
    )


def behavior_of(handler: grpc.RpcMethodHandler) -> Behavior:
    """The function that answers ``handler``'s calls, whatever its shape."""
    found = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    assert found is not None, "a method handler without a behaviour"
    return found  # type: ignore[no-any-return]


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    wrap: Callable[[Behavior, bool], Behavior],
) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour replaced by ``wrap(behavior, response_streaming)``: the
    same shape, the same (de)serializers."""
    return method_handler(
        wrap(behavior_of(handler), bool(handler.response_streaming)),
        request_streaming=bool(handler.request_streaming),
        response_streaming=bool(handler.response_streaming),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
