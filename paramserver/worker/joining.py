"""How a ``Worker`` joins a run: its options, checked before anything connects (``check``),
and the join of every shard's session (``join``): shard 0's plan, policy and manifest, the
local model (built from the plan when the caller brings none) and its sparse tables, each
shard's range of the flat buffer, and each range's payload path (``attach``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from paramserver import models
from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression
from paramserver.config import MAX_PUSH_EVERY, WIRE_CHOICES
from paramserver.config.base import check_seconds
from paramserver.errors import ConfigError
from paramserver.policy.staleness import Policy
from paramserver.worker.attach import Attacher
from paramserver.worker.flat import replica as flat_replica
from paramserver.worker.replica import Replica
from paramserver.worker.rows import WorkerTables
from paramserver.worker.session import Session
from paramserver.worker.shards import check_tiling, served_range


@dataclass(frozen=True)
class Joined:
    """What joining every shard gives the worker."""

    plan: pb.TrainingPlan
    policy: Policy
    model: nn.Module
    tables: WorkerTables
    replica: Replica
    codec: type[compression.Codec]
    ranges: list[tuple[int, int]]
    train_samples: int
    slots: int  # pushes in flight the policy allows
    attacher: Attacher


def check(push_every: int, compress: str, wire: str = "auto", **seconds: float) -> None:
    """The options, checked before anything connects; ``seconds``: the timeouts by name,
    within what the clocks carry (``check_seconds``), as the worker's options are.

    Raises:
        ConfigError: an option out of its range.
    """
    for name, value in seconds.items():
        check_seconds(name, value)
    if not 1 <= push_every <= MAX_PUSH_EVERY:
        raise ConfigError(f"push_every must be 1 to {MAX_PUSH_EVERY}; got {push_every}.")
    try:
        compression.by_name(compress)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if wire not in WIRE_CHOICES:
        raise ConfigError(f"wire must be one of {', '.join(WIRE_CHOICES)}; got {wire!r}.")


def join(
    sessions: Sequence[Session],
    model: nn.Module | None,
    device: str | torch.device | None,
    train_samples: int | Callable[[pb.TrainingPlan], int],
    *,
    rpc_timeout: float,
    cache_rows: int,
    rejoin: Callable[[], None],
    compress: str,
    shm: bool,
    shm_control: bool,
    remote: bool = True,
    flat: bool | None = None,
) -> Joined:
    """Join every shard: the plan, the policy and the manifest (shard 0's), the model
    (built if None) and its tables (``rejoin``: a row pull met a restarted server); then
    each shard's range and payload path; ``flat``: keep the model's state in flat tensors
    (None: on a GPU; ``worker/flat.py``)."""
    samples = 0 if callable(train_samples) else train_samples
    replies = [
        s.join(pb.JoinRequest(train_samples=samples if i == 0 else 0))
        for i, s in enumerate(sessions)
    ]
    plan, policy = replies[0].plan, Policy.parse(replies[0].policy)
    model = local_model(plan, model, device)
    tables = WorkerTables(model, replies[0].manifest, sessions, rpc_timeout, cache_rows, rejoin)
    replica = flat_replica(model, flat)
    manifest = replica.manifest
    params = (s.dtype for s in manifest.tensors if s.role == "param")
    codec = compression.by_name(compress, params, manifest.dtype)
    addresses = [s.address for s in sessions]
    ranges = [
        served_range(a, i, len(addresses), r, manifest)
        for i, (a, r) in enumerate(zip(addresses, replies, strict=True))
    ]
    check_tiling(ranges, addresses, manifest.numel)
    if callable(train_samples):
        samples = train_samples(plan)
    slots = policy.max_inflight_pushes()
    attacher = Attacher(
        sessions, ranges, manifest, slots, replica.device, codec, shm, shm_control, remote, samples
    )
    attacher.attach_all()
    return Joined(plan, policy, model, tables, replica, codec, ranges, samples, slots, attacher)


def local_model(
    plan: pb.TrainingPlan, model: nn.Module | None, device: str | torch.device | None
) -> nn.Module:
    """``model`` (the module inside, for a ``torch.compile``d one), or the one the servers
    name when it is None.

    Raises:
        ConfigError: the servers hold a user-supplied model, so it cannot be built here.
    """
    inner = getattr(model, "_orig_mod", None)  # torch.compile's wrapper (not imported here:
    if isinstance(inner, nn.Module):  # torch._dynamo is slow to load): it runs this module
        return inner
    if model is not None:
        return model
    if not plan.model:
        raise ConfigError(
            "The server holds a user-supplied model, so the worker cannot build it: pass the "
            "model to Worker(address, model)."
        )
    # the server's seed: parameters it never sends (frozen ones) start the same
    return models.build(plan.model, seed=plan.seed).to(device or "cpu")
