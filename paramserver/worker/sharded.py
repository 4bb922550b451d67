"""A worker of a run whose parameters are split over several servers (``--shard I/S``).

Each shard holds one contiguous range of the model's flat buffer (``layout.shard_range``).
The ShardedWorker keeps one ``Worker`` per shard, each over a one-tensor slice of that
range, and drives them together: a step copies the model's gradients into the slices and
pushes to every shard at once; a pull gathers every shard's range back into the model.
Shard 0 hands out the batches and says when the run is finished. Each connection keeps its
own retries, rejoins, shared-memory segment and prefetch; a restarted shard rewinds to its
own checkpoint while the others go on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch import nn

from paramserver import models
from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import layout
from paramserver.errors import ConfigError
from paramserver.stub import Stub
from paramserver.worker.client import Worker, _sync, connect

T = TypeVar("T")


class _Slice(nn.Module):
    """A shard's range of the flat parameters, as the one tensor its server serves."""

    def __init__(self, numel: int):
        super().__init__()
        self.flat = nn.Parameter(torch.zeros(numel))


class ShardedWorker:
    """``Worker`` for sharded servers: the same methods and attributes.

    Args:
        addresses: every shard's host:port, in shard order (0 first).
        model: the local replica; None: build the model the servers name.
        device: where to build the model when ``model`` is None (default: cpu).
        train_samples: as for ``Worker``: only shard 0 hands out batches.
        **kw: any other ``Worker`` argument, for every shard's connection.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        model: nn.Module | None = None,
        *,
        device: str | torch.device | None = None,
        train_samples: int | Callable[[pb.TrainingPlan], int] = 0,
        **kw: Any,
    ):
        if len(addresses) < 2:
            raise ConfigError("A sharded worker needs the addresses of at least 2 shards.")
        if model is None:
            model = models.build(_model_name(addresses[0], kw)).to(device or "cpu")
        self.model = model
        self._params = [p for _, p in models.parameters(model)]
        self.manifest = layout.Manifest.from_tensors(models.parameters(model))
        self.device = self._params[0].device if self._params else torch.device("cpu")
        shards = len(addresses)
        self._ranges = [layout.shard_range(self.manifest.numel, i, shards) for i in range(shards)]
        self._pool = ThreadPoolExecutor(shards, thread_name_prefix="ps-shard")
        self.shards: list[Worker] = []
        self._slices = [_Slice(hi - lo) for lo, hi in self._ranges]
        try:
            for i, address in enumerate(addresses):
                worker = Worker(address, self._slices[i], shard=(i, shards),
                                train_samples=train_samples if i == 0 else 0, **kw)  # fmt: skip
                self.shards.append(worker)
        except BaseException:
            self.close_quietly()
            raise
        self._flat = torch.empty(self.manifest.numel, dtype=torch.float32)
        self._gather()

    def _each(self, fn: Callable[[Worker], T]) -> list[T]:
        """``fn`` on every shard's connection at once; the first failure is raised."""
        return [f.result() for f in [self._pool.submit(fn, w) for w in self.shards]]

    def _gather(self) -> None:
        """Load every shard's range of the weights into the model."""
        for part, (lo, hi) in zip(self._slices, self._ranges, strict=True):
            self._flat[lo:hi].copy_(part.flat.detach())
        layout.unflatten_into(
            self.manifest, self._flat.to(self.device, non_blocking=True), self._params
        )
        _sync(self.device)

    # --- Worker's interface -----------------------------------------------------------

    def pull(self) -> None:
        """Pull every shard's range for iteration ``clock`` into the model."""
        self._each(lambda w: w.pull())
        self._gather()

    def step(
        self, samples: int = 0, loss: float = math.nan, pull: bool = True, empty: bool = False
    ) -> None:
        """Push the model's gradients to every shard, then pull the next weights."""
        if not empty:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
            layout.flatten_into(self.manifest, grads, self._flat)
            _sync(self.device)
            for part, (lo, hi) in zip(self._slices, self._ranges, strict=True):
                part.flat.grad = self._flat[lo:hi]
        for p in self._params:
            p.grad = None
        self._each(lambda w: w.step(samples, loss, pull=pull, empty=empty))
        if pull:
            self._gather()

    def flush(self) -> None:
        self._each(lambda w: w.flush())

    def status(self) -> pb.StatusResponse:
        """Shard 0's Status (its batches and samples are the run's)."""
        return self.shards[0].status()

    def close(self) -> None:
        try:
            self._each(lambda w: w.close())
        finally:
            self._pool.shutdown(wait=False)

    def close_quietly(self) -> None:
        for worker in self.shards:
            worker.close_quietly()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> ShardedWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        # clock, version, batch, batches, finished, plan, rank, worker_id, policy, ...: shard
        # 0's, which hands out the batches; rejoins and shm_active are over all shards.
        if name in ("shards", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.shards[0], name)

    @property
    def rejoins(self) -> int:
        return sum(w.rejoins for w in self.shards)

    @property
    def shm_active(self) -> bool:
        return all(w.shm_active for w in self.shards)


def _model_name(address: str, kw: dict[str, Any]) -> str:
    """The model shard 0 serves, from its Status."""
    channel = connect(address, kw.get("connect_timeout", 30.0), kw.get("security"))
    try:
        name = Stub(channel).Status(pb.StatusRequest(), timeout=kw.get("rpc_timeout", 60.0)).model
    finally:
        channel.close()
    if not name:
        raise ConfigError(
            "The servers hold a user-supplied model, so the worker cannot build it: pass it."
        )
    return name
