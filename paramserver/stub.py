"""The client side of the wire contract: the generated stub, with Push and Pull framed by the
codec's one-copy data chunks (the same bytes on the wire as the protobuf encoding)."""

from __future__ import annotations

import grpc

from paramserver import codec
from paramserver._proto import paramserver_pb2 as pb
from paramserver._proto import paramserver_pb2_grpc as pb_grpc

SERVICE = "paramserver.v1.ParameterServer"


class Stub(pb_grpc.ParameterServerStub):
    """``ParameterServerStub`` whose Push takes ``codec.encode_push`` streams and whose Pull
    yields ``codec.DataChunk``s for data (``codec.decode_pull`` reads both)."""

    def __init__(self, channel: grpc.Channel):
        super().__init__(channel)
        self.Push = channel.stream_unary(
            f"/{SERVICE}/Push",
            request_serializer=codec.serialize_chunk,
            response_deserializer=pb.PushResponse.FromString,
        )
        self.Pull = channel.unary_stream(
            f"/{SERVICE}/Pull",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=codec.parse_pull_chunk,
        )


def register(servicer: pb_grpc.ParameterServerServicer, server: grpc.Server) -> None:
    """Serve ``servicer``; Push reads and Pull writes data chunks through the codec."""
    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(
            servicer.Join,
            request_deserializer=pb.JoinRequest.FromString,
            response_serializer=pb.JoinResponse.SerializeToString,
        ),
        "Pull": grpc.unary_stream_rpc_method_handler(
            servicer.Pull,
            request_deserializer=pb.PullRequest.FromString,
            response_serializer=codec.serialize_chunk,
        ),
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push,
            request_deserializer=codec.parse_push_chunk,
            response_serializer=pb.PushResponse.SerializeToString,
        ),
        "PushPull": grpc.unary_unary_rpc_method_handler(
            servicer.PushPull,
            request_deserializer=pb.PushPullRequest.FromString,
            response_serializer=pb.PushPullResponse.SerializeToString,
        ),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            servicer.Heartbeat,
            request_deserializer=pb.HeartbeatRequest.FromString,
            response_serializer=pb.HeartbeatResponse.SerializeToString,
        ),
        "Leave": grpc.unary_unary_rpc_method_handler(
            servicer.Leave,
            request_deserializer=pb.LeaveRequest.FromString,
            response_serializer=pb.LeaveResponse.SerializeToString,
        ),
        "Status": grpc.unary_unary_rpc_method_handler(
            servicer.Status,
            request_deserializer=pb.StatusRequest.FromString,
            response_serializer=pb.StatusResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
