"""An in-process transport for ``Worker(transport=...)``: the stub's calls go straight to a
real Servicer and Coordinator in this process, with no sockets and a fake clock; faults are
injected per method."""

from __future__ import annotations

import collections
import copy
from collections.abc import Iterator
from typing import Any

import grpc
from torch import nn

from paramserver.codec.records import ControlError
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.server.app import build_coordinator
from paramserver.server.checkpointer import Checkpointer
from paramserver.server.coordinator import Coordinator
from paramserver.server.servicer import Servicer
from paramserver.transport.shm import Attachments
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
            self.checkpointer = Checkpointer(coordinator, cfg.checkpoint_dir,
                                             cfg.checkpoint_every, cuts=True)  # fmt: skip
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

    def stub(self, _address: str = "") -> InProcessStub:
        return InProcessStub(self)


class InProcessStub:
    """The client stub's methods, answered by ``server``'s servicer.

    ``fail[method]`` holds status codes to raise on that method's next calls, before the
    server sees them; ``lose[method]`` counts calls whose reply is lost after the server
    answered (the call raised UNAVAILABLE, as a dropped connection would)."""

    def __init__(self, server: FakeServer):
        self.server = server
        self.fail: dict[str, collections.deque[grpc.StatusCode]] = collections.defaultdict(
            collections.deque
        )
        self.lose: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.closed = False

    def _call(self, method: str, request: Any, timeout: float | None) -> Any:
        self.calls[method] += 1
        if self.fail[method]:
            raise FakeRpcError(self.fail[method].popleft(), f"{method} failed by the test")
        handler = getattr(self.server.servicer, method)
        result = handler(request, FakeContext(timeout))
        if isinstance(result, Iterator):
            result = list(result)  # a stream: its errors are raised here, as gRPC's are
        if self.lose[method]:
            self.lose[method] -= 1
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, f"reply of {method} lost")
        return iter(result) if isinstance(result, list) else result

    def Join(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        return self._call("Join", request, timeout)

    def Pull(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        return self._call("Pull", request, timeout)

    def Push(self, chunks: Any, timeout: float | None = None) -> Any:  # noqa: N802
        return self._call("Push", iter(chunks), timeout)

    def PushPull(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        return self._call("PushPull", request, timeout)

    def Heartbeat(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        return self._call("Heartbeat", request, timeout)

    def Leave(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        return self._call("Leave", request, timeout)

    def Status(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        return self._call("Status", request, timeout)

    def Rewind(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        return self._call("Rewind", request, timeout)

    def close(self) -> None:
        self.closed = True
