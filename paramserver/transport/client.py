"""The seam between a worker's session and one server: ``Channel``, everything a session
sends (join, heartbeat, leave, status, rewind, row pulls, and a step's push, pull and both)
and the buffers its payloads use. ``GrpcChannel`` is it over gRPC (a ``Stub`` and the
payload channel of ``channels.py``); ``grpc_channels`` makes one per address.

A session owns its channel: it makes it with a factory (one call, the server's address),
``offer``s payload buffers with each Join, ``open``s the path the server accepted (or
``withdraw``s the offer when the Join failed) and ``close``s it when it leaves. Calls raise
``grpc.RpcError`` on failure (the session retries and translates them). Tests put an
in-process channel at this seam (``tests/inprocess.py``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression
from paramserver.codec import rows as sparse_wire
from paramserver.config import Security
from paramserver.transport import shm as shmem
from paramserver.transport import tcp
from paramserver.transport.channels import (
    ControlSocket,
    GrpcStreamChannel,
    PayloadChannel,
    new_segment,
    open_control,
)
from paramserver.transport.shm_channel import ShmChannel
from paramserver.transport.stub import Stub, connect


@dataclass(frozen=True)
class PayloadSpec:
    """What one session's payloads are: a range of ``nbytes`` bytes of ``dtype`` elements
    with ``slots`` push slots; ``streams`` (weights, slots) are the buffers streamed payloads use;
    ``codec`` encodes streamed gradients. ``shm``: offer a shared segment; ``control``: use
    the server's control socket if it offers one; ``remote``: use the server's data port
    if it offers one (without the segment); either connecting within ``timeout``.
    ``pinned``: page-lock the segment (a CUDA worker's: ``pinned.py``)."""

    nbytes: int
    dtype: str
    slots: int
    streams: tuple[torch.Tensor, list[torch.Tensor]]
    codec: compression.Codec
    shm: bool = True
    control: bool = True
    timeout: float = 60.0
    remote: bool = True
    pinned: bool = False


class Channel(abc.ABC):
    """Everything a session sends to one server, and its payload buffers.

    The payload calls and buffers (``push``, ``pull``, ``push_pull``; ``weights``, ``slots``,
    ``shm``) are those of the path the last ``open`` chose.
    """

    # --- membership and queries: one call each ------------------------------------------

    @abc.abstractmethod
    def join(self, request: pb.JoinRequest, timeout: float | None = None) -> pb.JoinResponse:
        """Join (or, with the worker's id in ``request``, join again)."""

    @abc.abstractmethod
    def heartbeat(
        self, request: pb.HeartbeatRequest, timeout: float | None = None
    ) -> pb.HeartbeatResponse: ...

    @abc.abstractmethod
    def leave(self, request: pb.LeaveRequest, timeout: float | None = None) -> pb.LeaveResponse: ...

    @abc.abstractmethod
    def status(
        self, request: pb.StatusRequest, timeout: float | None = None
    ) -> pb.StatusResponse: ...

    @abc.abstractmethod
    def rewind(
        self, request: pb.RewindRequest, timeout: float | None = None
    ) -> pb.RewindResponse: ...

    @abc.abstractmethod
    def pull_rows(self, request: pb.RowsRequest, timeout: float | None = None) -> pb.RowsResponse:
        """Rows of the sparse tables."""

    @abc.abstractmethod
    def step_norm(
        self, request: pb.StepNormRequest, timeout: float | None = None
    ) -> pb.StepNormResponse:
        """A sync round's norm over the shards (``worker/norm_relay.py``)."""

    # --- the payload path -----------------------------------------------------------------

    @abc.abstractmethod
    def offer(self, request: pb.JoinRequest, spec: PayloadSpec) -> None:
        """Offer the server buffers for ``spec``'s payloads in the Join ``request`` (a shared
        segment, named there); the next ``open`` or ``withdraw`` settles the offer."""

    @abc.abstractmethod
    def open(self, reply: pb.JoinResponse) -> None:
        """The Join was answered with ``reply``: open the payload path it accepted (shared
        memory, or streams over ``spec.streams``), releasing the previous one."""

    @abc.abstractmethod
    def withdraw(self) -> None:
        """The Join failed: release what ``offer`` made."""

    @property
    @abc.abstractmethod
    def shm(self) -> bool:
        """Whether the payloads go through a shared segment the server mapped."""

    @property
    @abc.abstractmethod
    def weights(self) -> torch.Tensor:
        """Where a pull's weights land."""

    @property
    @abc.abstractmethod
    def slots(self) -> list[torch.Tensor]:
        """Where each push slot's gradient is staged."""

    @property
    @abc.abstractmethod
    def description(self) -> str:
        """How the payloads and the steps travel, for the log."""

    @abc.abstractmethod
    def push(self, header: pb.PushHeader, slot: int, timeout: float) -> pb.PushResponse:
        """Send the gradient in ``slots[slot]`` (none if ``header.empty``)."""

    @abc.abstractmethod
    def pull(self, request: pb.PullRequest, timeout: float) -> pb.PullHeader:
        """Receive the weights the request asks for into ``weights``."""

    @abc.abstractmethod
    def push_pull(
        self, header: pb.PushHeader, slot: int, request: pb.PullRequest, timeout: float
    ) -> pb.PullHeader:
        """``push``, then ``pull``: one round trip where the path can."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the payload path and the connection."""

    @property
    def takes_pieces(self) -> bool:
        """Whether a push may be sent from the gradients themselves (``stage``)."""
        return False

    def stage(self, slot: int, pieces: list[torch.Tensor] | None) -> bool:
        """Whether the push staged in ``slot`` will be sent from ``pieces`` (views of the
        gradients, in order, of the flat buffer's dtype) instead of ``slots[slot]``; False:
        the caller copies the gradients into the slot (and pieces staged there before are
        forgotten)."""
        return False

    def row_messages(
        self, parts: Sequence[sparse_wire.RowGradients], slot: int
    ) -> list[pb.RowGradients]:
        """The messages of a push's table rows ``parts`` for the header of the push staged in
        ``slot``: with their values, or with the values written where the payload path
        carries them (a shared segment's rows part for that slot). A retry of the push sends
        the same messages: the slot is the push's until it is answered."""
        return [sparse_wire.gradients_to_proto(p) for p in parts]


ChannelFactory = Callable[[str], Channel]


class GrpcChannel(Channel):
    """A ``Channel`` over gRPC: the calls on ``stub``, the payloads on the ``PayloadChannel``
    that ``open_channel`` picks (``payloads``): the data port of ``address``'s host is
    dialled with ``security``."""

    def __init__(self, stub: Any, address: str = "", security: Security | None = None):
        self.stub = stub
        self.address, self.security = address, security or Security()
        self.payloads: PayloadChannel | None = None
        self._offered: tuple[shmem.Segment | None, PayloadSpec] | None = None

    def join(self, request: pb.JoinRequest, timeout: float | None = None) -> pb.JoinResponse:
        return self.stub.Join(request, timeout=timeout)  # type: ignore[no-any-return]

    def heartbeat(
        self, request: pb.HeartbeatRequest, timeout: float | None = None
    ) -> pb.HeartbeatResponse:
        return self.stub.Heartbeat(request, timeout=timeout)  # type: ignore[no-any-return]

    def leave(self, request: pb.LeaveRequest, timeout: float | None = None) -> pb.LeaveResponse:
        return self.stub.Leave(request, timeout=timeout)  # type: ignore[no-any-return]

    def status(self, request: pb.StatusRequest, timeout: float | None = None) -> pb.StatusResponse:
        return self.stub.Status(request, timeout=timeout)  # type: ignore[no-any-return]

    def rewind(self, request: pb.RewindRequest, timeout: float | None = None) -> pb.RewindResponse:
        return self.stub.Rewind(request, timeout=timeout)  # type: ignore[no-any-return]

    def step_norm(
        self, request: pb.StepNormRequest, timeout: float | None = None
    ) -> pb.StepNormResponse:
        return self.stub.StepNorm(request, timeout=timeout)  # type: ignore[no-any-return]

    def pull_rows(self, request: pb.RowsRequest, timeout: float | None = None) -> pb.RowsResponse:
        """A row pull: its values through the shared segment where the payloads go there."""
        payloads = self.payloads
        if isinstance(payloads, ShmChannel):
            return payloads.pull_rows(self.stub, request, timeout)
        return self.stub.PullRows(request, timeout=timeout)  # type: ignore[no-any-return]

    def offer(self, request: pb.JoinRequest, spec: PayloadSpec) -> None:
        self.withdraw()
        segment = new_segment(spec.nbytes, spec.slots, spec.dtype) if spec.shm else None
        if segment is not None:
            request.shm_name, request.shm_nonce = segment.name, segment.nonce
            request.shm_slots = segment.nslots
            request.shm_rows_bytes = segment.rows_bytes
        self._offered = (segment, spec)

    def open(self, reply: pb.JoinResponse) -> None:
        assert self._offered is not None, "open follows an offer"
        (segment, spec), self._offered = self._offered, None
        old, self.payloads = (
            self.payloads,
            open_channel(self.stub, segment, reply, spec, self.address, self.security),
        )
        if old is not None:
            old.close()

    def withdraw(self) -> None:
        offered, self._offered = self._offered, None
        if offered is not None and offered[0] is not None:
            offered[0].close()

    @property
    def _path(self) -> PayloadChannel:
        assert self.payloads is not None, "the payload path opens after a Join"
        return self.payloads

    @property
    def shm(self) -> bool:
        return self.payloads is not None and self.payloads.shm

    @property
    def weights(self) -> torch.Tensor:
        return self._path.weights

    @property
    def slots(self) -> list[torch.Tensor]:
        return self._path.slots

    @property
    def control(self) -> ControlSocket | None:
        """The server's same-host control socket the steps go over, if any."""
        return getattr(self.payloads, "control", None)

    @property
    def data_port(self) -> bool:
        """Whether the payloads go over the server's data port (not failed since the Join)."""
        payloads = self.payloads
        return isinstance(payloads, tcp.TcpChannel) and payloads.data is not None

    @property
    def page_locked(self) -> bool:
        """Whether the payload buffers are page-locked (``transport/pinned.py``)."""
        return self.payloads is not None and self.payloads.page_locked

    @property
    def segment(self) -> shmem.Segment | None:
        """The shared segment the payloads travel in, if any."""
        return getattr(self.payloads, "segment", None)

    @property
    def description(self) -> str:
        return self.payloads.description if self.payloads is not None else "not open"

    @property
    def takes_pieces(self) -> bool:
        return self._path.takes_pieces

    def stage(self, slot: int, pieces: list[torch.Tensor] | None) -> bool:
        return self._path.stage(slot, pieces)

    def row_messages(
        self, parts: Sequence[sparse_wire.RowGradients], slot: int
    ) -> list[pb.RowGradients]:
        return self._path.row_messages(parts, slot)

    def push(self, header: pb.PushHeader, slot: int, timeout: float) -> pb.PushResponse:
        return self._path.push(header, slot, timeout)

    def pull(self, request: pb.PullRequest, timeout: float) -> pb.PullHeader:
        return self._path.pull(request, timeout)

    def push_pull(
        self, header: pb.PushHeader, slot: int, request: pb.PullRequest, timeout: float
    ) -> pb.PullHeader:
        return self._path.push_pull(header, slot, request, timeout)

    def close(self) -> None:
        self.withdraw()
        try:
            if self.payloads is not None:
                self.payloads.close()
        finally:
            self.stub.close()


def grpc_channels(
    connect_timeout: float = 30.0,
    security: Security | None = None,
    stubs: Callable[[str], Any] | None = None,
) -> ChannelFactory:
    """A factory of ``GrpcChannel``s: each on ``stubs(address)``, by default a ``Stub`` on a
    gRPC channel with ``security``, connected within ``connect_timeout`` seconds."""
    make = stubs or (lambda address: Stub(connect(address, connect_timeout, security)))
    return lambda address: GrpcChannel(make(address), address, security)


def open_channel(
    stub: Stub,
    segment: shmem.Segment | None,
    reply: pb.JoinResponse,
    spec: PayloadSpec,
    address: str,
    security: Security,
) -> PayloadChannel:
    """The payload path of a session that offered ``segment`` (or none) at Join and got
    ``reply``: shared memory if the server mapped it (steps over its control socket if it
    offered one and ``spec.control``), else the data port of ``address``'s host if the
    server offered one and ``spec.remote``, else gRPC streams; the last two over
    ``spec.streams``' buffers.

    The segment's name is unlinked either way: the server holds its mapping, or declined.
    """
    if segment is not None:
        segment.unlink()
        if reply.shm:
            name = reply.shm_control if spec.control else ""
            control = open_control(name, reply.worker_id, segment.nonce, spec.timeout)
            codec = None if spec.codec.raw else spec.codec
            return ShmChannel(stub, segment, control, codec, pin=spec.pinned)
        segment.close()
    weights, slots = spec.streams
    streams = GrpcStreamChannel(stub, weights, slots, spec.codec, reply.chunk_bytes)
    data = tcp.connect(address, reply, security, spec.timeout) if spec.remote else None
    return streams if data is None else tcp.TcpChannel(data, streams)
