"""The client side of the wire contract: the generated stub, with Push and Pull framed by the
codec's one-copy data chunks (the same bytes on the wire as the protobuf encoding)."""

from __future__ import annotations

from typing import Any

import grpc

from paramserver._proto import paramserver_pb2 as pb
from paramserver._proto import paramserver_pb2_grpc as pb_grpc
from paramserver.codec import wire

SERVICE = "paramserver.v1.ParameterServer"


class Stub(pb_grpc.ParameterServerStub):
    """``ParameterServerStub`` whose Push takes ``wire.encode_push`` streams and whose Pull
    yields ``wire.DataChunk``s for data (``wire.decode_pull`` reads both)."""

    def __init__(self, channel: grpc.Channel):
        super().__init__(channel)
        self.Push = channel.stream_unary(
            f"/{SERVICE}/Push",
            request_serializer=wire.serialize_chunk,
            response_deserializer=pb.PushResponse.FromString,
        )
        self.Pull = channel.unary_stream(
            f"/{SERVICE}/Pull",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=wire.parse_pull_chunk,
        )


# The unary RPCs: name -> (request type, response type), served with protobuf's own framing.
_UNARY: dict[str, tuple[Any, Any]] = {
    "Join": (pb.JoinRequest, pb.JoinResponse),
    "PushPull": (pb.PushPullRequest, pb.PushPullResponse),
    "Heartbeat": (pb.HeartbeatRequest, pb.HeartbeatResponse),
    "Leave": (pb.LeaveRequest, pb.LeaveResponse),
    "Status": (pb.StatusRequest, pb.StatusResponse),
}


def register(servicer: pb_grpc.ParameterServerServicer, server: grpc.Server) -> None:
    """Serve ``servicer``; Push reads and Pull writes data chunks through the codec."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
        for name, (request, response) in _UNARY.items()
    }
    handlers["Pull"] = grpc.unary_stream_rpc_method_handler(
        servicer.Pull,
        request_deserializer=pb.PullRequest.FromString,
        response_serializer=wire.serialize_chunk,
    )
    handlers["Push"] = grpc.stream_unary_rpc_method_handler(
        servicer.Push,
        request_deserializer=wire.parse_push_chunk,
        response_serializer=pb.PushResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
