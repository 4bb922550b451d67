"""The client side of the wire contract: ``connect`` to a server, and the generated stub with
Push and Pull framed by the codec's one-copy data chunks (the same bytes on the wire as the
protobuf encoding)."""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from paramserver._proto import paramserver_pb2 as pb
from paramserver._proto import paramserver_pb2_grpc as pb_grpc
from paramserver.codec import wire
from paramserver.config import MAX_MESSAGE_BYTES, Security
from paramserver.errors import ServerUnavailable
from paramserver.transport import probe, security

log = logging.getLogger(__name__)
SERVICE = "paramserver.v1.ParameterServer"
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # gRPC's own reconnect backoff (1 s, x1.6 a failed try, up to 120 s) left a worker whose
    # server was down ten seconds waiting about six more once it was back, past a lease.
    # The worker's retries already have their budget and jitter (worker/waits.py): the
    # channel tries again at least once a second.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def connect(
    address: str, timeout: float, sec: Security | None = None, every: float = 10.0
) -> grpc.Channel:
    """A channel to ``address`` (with ``sec``'s TLS and token) that is known to be connected.
    While nothing answers it logs that it waits, for whom and until when: after the first
    second, then every ``every`` seconds.

    Raises:
        ServerUnavailable: nothing answers at ``address`` within ``timeout`` seconds.
    """
    sec = sec or Security()
    channel = security.client_channel(address, sec, CHANNEL_OPTIONS)
    # without TLS, a port that answers but not as gRPC is said at once (with TLS the
    # handshake comes first: what the port is shows on the first call)
    check = None if sec.tls else (lambda: probe.not_grpc(address))
    try:
        ready = _ready(channel, address, timeout, every, check)
    except ServerUnavailable:
        channel.close()
        raise
    if not ready:
        channel.close()
        hint = (
            " With TLS: is the server's certificate signed by --tls-ca, and does the server "
            "accept this client's certificate?"
            if sec.tls
            else " If the server uses TLS, pass --tls-ca (and --tls-cert/--tls-key)."
        )
        raise ServerUnavailable(
            f"No parameter server answered at {address} within {timeout:g}s: is it running, "
            f"and is the address right?{hint}"
        ) from None
    return channel


def _ready(
    channel: grpc.Channel,
    address: str,
    timeout: float,
    every: float,
    check: Callable[[], str | None] | None = None,
) -> bool:
    """Whether ``channel`` connects within ``timeout`` seconds, saying while it waits;
    ``check``, once the first second found no gRPC there: why the address cannot be a
    parameter server's port, if it certainly is not.

    Raises:
        ServerUnavailable: ``check`` found a reason.
    """
    ready = grpc.channel_ready_future(channel)
    start = time.monotonic()
    until = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    step = min(1.0, timeout)
    while True:
        left = timeout - (time.monotonic() - start)
        try:
            ready.result(timeout=max(min(step, left), 0.0))
            return True
        except grpc.FutureTimeoutError:
            if check is not None and (why := check()) is not None:
                ready.cancel()
                raise ServerUnavailable(
                    f"{address} is not a parameter server's port: {why}."
                ) from None
            check = None  # once
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                ready.cancel()
                return False
        log.info(
            "waiting for a parameter server to answer at %s: %.0fs so far, until %s (%.0fs more)",
            address,
            time.monotonic() - start,
            until.strftime("%H:%M:%S"),
            left,
        )
        step = every


class Stub(pb_grpc.ParameterServerStub):
    """``ParameterServerStub`` whose Push takes ``wire.encode_push`` streams and whose Pull
    yields ``wire.DataChunk``s for data (``wire.decode_pull`` reads both)."""

    def __init__(self, channel: grpc.Channel):
        super().__init__(channel)
        self.channel = channel
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

    def close(self) -> None:
        self.channel.close()


# The unary RPCs: name -> (request type, response type), served with protobuf's own framing.
_UNARY: dict[str, tuple[Any, Any]] = {
    "Join": (pb.JoinRequest, pb.JoinResponse),
    "PushPull": (pb.PushPullRequest, pb.PushPullResponse),
    "Heartbeat": (pb.HeartbeatRequest, pb.HeartbeatResponse),
    "Leave": (pb.LeaveRequest, pb.LeaveResponse),
    "Status": (pb.StatusRequest, pb.StatusResponse),
    "Rewind": (pb.RewindRequest, pb.RewindResponse),
    "PullRows": (pb.RowsRequest, pb.RowsResponse),
    "StepNorm": (pb.StepNormRequest, pb.StepNormResponse),
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
