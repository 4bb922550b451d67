"""A worker's view of the shards: their addresses, which range of the model's flat buffer
each server holds (read from its JoinResponse: ``shard``, ``shards``, ``shard_offset``, its
manifest; checked against the addresses the worker was given and the local model; the
servers cut the ranges with ``codec.layout.shard_range``), and bringing every shard back to
one cut after one of them restarted."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec.layout import Manifest
from paramserver.errors import ConfigError, WrongIncarnation
from paramserver.worker.session import Session

log = logging.getLogger(__name__)


def addresses_of(address: str | Sequence[str]) -> list[str]:
    """Every shard's address, in shard order, from a list or "A,B,...".

    Raises:
        ConfigError: none given, or an empty one.
    """
    addresses = address.split(",") if isinstance(address, str) else list(address)
    if not addresses or not all(addresses):
        raise ConfigError(f"Give the server's address (host:port); got {address!r}.")
    return addresses


def served_range(
    address: str, i: int, given: int, reply: pb.JoinResponse, local: Manifest
) -> tuple[int, int]:
    """The elements [lo, hi) that the server at ``address``, given as shard ``i`` of
    ``given``, holds.

    Raises:
        ConfigError: it is another shard, the list of addresses is incomplete, or its
            model does not match ``local``.
    """
    shards = max(reply.shards, 1)
    if shards != given or reply.shard != i:
        if given == 1:
            raise ConfigError(
                f"The server at {address} holds shard {reply.shard} of {shards} of the "
                "parameters: give the worker every shard's address, in order (--server "
                "A,B,...; paramserver.Worker([A, B, ...]) in Python)."
            )
        raise ConfigError(
            f"The server at {address} is shard {reply.shard} of {shards}, but it was given "
            f"as shard {i} of {given}: list every shard's address in shard order."
        )
    served = Manifest.from_proto(reply.manifest)
    if shards == 1:
        served.check_compatible(local, "the local model")
        return 0, local.numel
    if reply.model_numel != local.numel:
        raise ConfigError(
            f"The servers hold a model of {reply.model_numel} parameters; the local model "
            f"has {local.numel}."
        )
    return reply.shard_offset, reply.shard_offset + served.numel


def check_tiling(ranges: Sequence[tuple[int, int]], addresses: Sequence[str], numel: int) -> None:
    """The shards' ranges must tile the flat buffer of ``numel`` elements, in order.

    Raises:
        ConfigError: a gap, an overlap, or a range past the end.
    """
    end = 0
    for i, (lo, hi) in enumerate(ranges):
        if lo != end or hi > numel:
            raise ConfigError(
                f"Shard {i} at {addresses[i]} holds elements {lo} to {hi} of the flat buffer "
                f"of {numel}, which do not follow the previous shard's: are all shards "
                "started with the same model?"
            )
        end = hi
    if end != numel:
        raise ConfigError(f"The shards hold {end} of the model's {numel} parameters.")


def rewind_ahead(sessions: Sequence[Session]) -> None:
    """A shard restarted from its newest consistent cut, where every worker's clock is the
    cut's: ask every shard that is ahead of it to rewind to the same cut, and mark those
    sessions lost so that the worker joins them again; the run resumes as one model, and
    every batch after the cut is computed again. A shard that restarted as well (every
    shard was killed) answers as a new incarnation: it is joined again and rewound then."""
    low = min(s.clock for s in sessions)
    # the restart to rewind for: the origin of a shard at the cut (a shard rewound for it
    # already, or the restarted one itself, is of that origin and is left as it is, even
    # where this worker's own push of the cut's round took it a step past the cut)
    cause = next(s.origin for s in sessions if s.clock == low)
    for s in sessions:
        if s.clock == low or s.origin == cause:
            continue
        log.warning(
            "shard at %s is at clock %d, another restarted at clock %d: rewinding it to that cut",
            s.address,
            s.clock,
            low,
        )
        request = pb.RewindRequest(
            round=low, incarnation=s.incarnation, worker_id=s.worker_id, cause=cause
        )
        # another worker rewound it first, or it restarted too (every shard was killed):
        # either way it is lost, joined again next, and brought back to the cut then; a
        # shard still restarting is waited for, as any call is
        with contextlib.suppress(WrongIncarnation):
            s.retrying("rewind", functools.partial(s.channel.rewind, request, s.rpc_timeout))
        s.lose(WrongIncarnation(f"The server at {s.address} rewound to round {low}."))
