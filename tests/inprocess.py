"""An in-process channel for ``Worker(channel=...)``: a ``Channel`` (``transport/client.py``)
whose calls go straight to a real Servicer and Coordinator in this process, with no sockets,
no stub and a fake clock; faults are injected per method."""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import torch
from torch import nn

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import wire
from paramserver.codec.records import ControlError
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.server.build import build_coordinator
from paramserver.server.disk.checkpoint_writer import Checkpointer
from paramserver.server.doors.servicer import Servicer
from paramserver.server.engine.coordinator import Coordinator
from paramserver.transport.attachments import Attachments
from paramserver.transport.channels import encode, new_segment
from paramserver.transport.client import Channel, PayloadSpec
from paramserver.transport.shm import Segment
from tests.conftest import FakeClock

# a failed call as the stub raises it: the control socket's error is one already
FakeRpcError = ControlError


class FakeContext:
    """What a servicer method uses of ``grpc.ServicerContext``."""

    def __init__(self, timeout: float | None):
        self.timeout = timeout

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise FakeRpcError(code, details)

    def add_callback(self, _callback: Any) -> None:
        pass

    def time_remaining(self) -> float | None:
        return self.timeout

    def is_active(self) -> bool:
        return True

    def peer(self) -> str:
        return "in-process"


class FakeServer:
    """A server's state and servicer, without gRPC. ``restart()`` is a new incarnation that
    resumes from the old one's current state, or, for a shard with a checkpoint folder, from
    its newest consistent cut (as a shard restarted after kill -9 does)."""

    def __init__(self, model: nn.Module, clock: FakeClock, **settings: Any):
        settings.setdefault("optimizer", OptimizerConfig("sgd", lr=0.5))
        settings.setdefault("lease_seconds", 10.0)
        self.config = ServerConfig(**settings)
        self.clock = clock
        self.model = copy.deepcopy(model)
        self.checkpointer: Checkpointer | None = None
        self._serve(build_coordinator(self.config, model, now=clock))

    def _serve(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        rewind = None
        if self.config.cuts:
            cfg = self.config
            assert cfg.checkpoint_dir is not None
            self.checkpointer = Checkpointer(
                coordinator, cfg.checkpoint_dir, cfg.checkpoint_every, cuts=True
            )
            self.checkpointer.start()
            rewind = self.checkpointer.rewind
        self.shared = Attachments(coordinator.manifest.total_bytes, coordinator.manifest.dtype)
        self.servicer = Servicer(coordinator, self.shared, rewind)

    def restart(self) -> None:
        self.shared.close()
        model = copy.deepcopy(self.model)
        if self.checkpointer is not None:
            self.checkpointer.write_cuts()  # what the dead process had written
            self.checkpointer.abandon()  # no last checkpoint: it died
            self._serve(build_coordinator(self.config, model, self.clock, resume=True))
            return
        state = self.coordinator.checkpoint_state()
        self._serve(build_coordinator(self.config, model, self.clock, snapshot=state))

    def channel(self, _address: str = "") -> InProcessChannel:
        return InProcessChannel(self)


def shards_with_cuts(
    model: nn.Module, clock: FakeClock, checkpoint_dir: str, **settings: Any
) -> dict[str, FakeServer]:
    """Two shards of ``model``, ``s0`` and ``s1``, writing a consistent cut every 2 rounds
    into ``checkpoint_dir`` (so that ``restart()`` goes back to the newest one)."""
    return {
        f"s{i}": FakeServer(
            model,
            clock,
            shard=i,
            shards=2,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every="2",
            **settings,
        )
        for i in range(2)
    }


class InProcessChannel(Channel):
    """A worker session's channel, answered by ``server``'s servicer. Payloads go through a
    shared segment when the session offers one (the server maps it as a real one does), else
    as a stream's chunks.

    Faults are per method, the RPC a gRPC channel makes (Join, Heartbeat, Leave, Status,
    Rewind, PullRows; a push and a pull are Push and Pull when streamed, and PushPull through
    shared memory): ``fail[method]`` holds status codes to raise on its next calls, before the
    server sees them; ``lose[method]`` counts calls whose reply is lost after the server
    answered (the call raises UNAVAILABLE, as a dropped connection would)."""

    def __init__(self, server: FakeServer):
        self.server = server
        self.fail: dict[str, collections.deque[grpc.StatusCode]] = collections.defaultdict(
            collections.deque
        )
        self.lose: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.closed = False
        self._offered: tuple[Segment | None, PayloadSpec] | None = None
        self.segment: Segment | None = None
        self._buffers: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._spec: PayloadSpec | None = None
        self._chunk_bytes = wire.DEFAULT_CHUNK_BYTES

    def _call(self, method: str, request: Any, timeout: float | None) -> Any:
        self.calls[method] += 1
        if self.fail[method]:
            raise FakeRpcError(self.fail[method].popleft(), f"{method} failed by the test")
        handler: Callable[..., Any] = getattr(self.server.servicer, method)
        result = handler(request, FakeContext(timeout))
        if isinstance(result, Iterator):
            result = list(result)  # a stream: its errors are raised here, as gRPC's are
        if self.lose[method]:
            self.lose[method] -= 1
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, f"reply of {method} lost")
        return result

    # --- membership and queries -------------------------------------------------------

    def join(self, request: Any, timeout: float | None = None) -> Any:
        return self._call("Join", request, timeout)

    def heartbeat(self, request: Any, timeout: float | None = None) -> Any:
        return self._call("Heartbeat", request, timeout)

    def leave(self, request: Any, timeout: float | None = None) -> Any:
        return self._call("Leave", request, timeout)

    def status(self, request: Any, timeout: float | None = None) -> Any:
        return self._call("Status", request, timeout)

    def rewind(self, request: Any, timeout: float | None = None) -> Any:
        return self._call("Rewind", request, timeout)

    def pull_rows(self, request: Any, timeout: float | None = None) -> Any:
        return self._call("PullRows", request, timeout)

    def step_norm(self, request: Any, timeout: float | None = None) -> Any:
        return self._call("StepNorm", request, timeout)

    # --- the payload path -------------------------------------------------------------

    def offer(self, request: pb.JoinRequest, spec: PayloadSpec) -> None:
        self.withdraw()
        segment = new_segment(spec.nbytes, spec.slots, spec.dtype) if spec.shm else None
        if segment is not None:
            request.shm_name, request.shm_nonce = segment.name, segment.nonce
            request.shm_slots = segment.nslots
            request.shm_rows_bytes = segment.rows_bytes
        self._offered = (segment, spec)

    def open(self, reply: pb.JoinResponse) -> None:
        assert self._offered is not None
        (segment, spec), self._offered = self._offered, None
        if segment is not None:
            segment.unlink()  # the server holds it open, or declined
            if not reply.shm:
                segment.close()
                segment = None
        if self.segment is not None:
            self.segment.close()
        self.segment, self._spec = segment, spec
        self._chunk_bytes = reply.chunk_bytes or wire.DEFAULT_CHUNK_BYTES
        if segment is None:
            self._buffers = spec.streams
        else:
            self._buffers = (
                torch.from_numpy(segment.weights),
                [torch.from_numpy(a) for a in segment.slots],
            )

    def withdraw(self) -> None:
        offered, self._offered = self._offered, None
        if offered is not None and offered[0] is not None:
            offered[0].close()

    @property
    def shm(self) -> bool:
        return self.segment is not None

    @property
    def weights(self) -> torch.Tensor:
        assert self._buffers is not None
        return self._buffers[0]

    @property
    def slots(self) -> list[torch.Tensor]:
        assert self._buffers is not None
        return self._buffers[1]

    @property
    def description(self) -> str:
        return "in process, " + ("in shared memory" if self.shm else "streamed")

    def push(self, header: pb.PushHeader, slot: int, timeout: float) -> Any:
        if self.shm:
            header.shm, header.shm_slot = True, slot
            return self._call("PushPull", pb.PushPullRequest(push=header), timeout).push
        assert self._spec is not None
        payload = memoryview(b"")
        if not header.empty:
            payload = encode(self._spec.codec, header, self.slots[slot], slot)
        chunks = wire.encode_push(header, payload, self._chunk_bytes)
        return self._call("Push", iter(list(chunks)), timeout)

    def pull(self, request: pb.PullRequest, timeout: float) -> Any:
        if self.shm:
            request.shm = True
            return self._call("PushPull", pb.PushPullRequest(pull=request), timeout).pull
        out = self.weights.numpy()
        header, _ = wire.decode_pull(iter(self._call("Pull", request, timeout)), out, out.nbytes)
        return header

    def push_pull(
        self, header: pb.PushHeader, slot: int, request: pb.PullRequest, timeout: float
    ) -> Any:
        if not self.shm:
            self.push(header, slot, timeout)
            return self.pull(request, timeout)
        header.shm, header.shm_slot, request.shm = True, slot, True
        both = pb.PushPullRequest(push=header, pull=request)
        return self._call("PushPull", both, timeout).pull

    def close(self) -> None:
        self.withdraw()
        if self.segment is not None:
            self.segment.close()
        self.closed = True
