"""A worker's view of the shards: their addresses, which range of the model's flat buffer
each server holds (read from its JoinResponse: ``shard``, ``shards``, ``shard_offset``, its
manifest; checked against the addresses the worker was given and the local model; the
servers cut the ranges with ``codec.layout.shard_range``), bringing every shard back to
one cut after one of them restarted, and keeping a worker's clock the same on every shard.

Why the clocks must agree: a shard's cut at clock c holds the pushes of iterations below c,
so a gradient must be the same iteration on every shard, or two shards' cuts at c hold
different batches. A worker that joins (or joins again under a new id) starts at each
shard's own round, and shards finish a round at different moments (shard 0 gets every
push last), so it may start one round apart: ``align_clocks`` then pushes empty pushes to
the shards behind (an empty push counts for the round and applies nothing) until every
clock is the highest. Without it, a shard that restarts from such a cut makes the others
rewind to a cut that lacks a batch shard 0 counts done: that batch is never trained
there."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec.layout import Manifest
from paramserver.errors import ConfigError, RejoinRequired, ServerRewound, WrongIncarnation
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


def align_clocks(sessions: Sequence[Session], push_empty: Callable[[Session, int], object]) -> None:
    """Bring this worker's clock on every shard to the highest, with empty pushes
    (``push_empty(session, iteration)``) to the shards behind (see the module's docstring).
    A session lost meanwhile stops it: the worker joins it again, then aligns again."""
    top = max(s.clock for s in sessions)
    for s in sessions:
        if s.clock < top and not s.lost:
            log.warning(
                "joined the shard at %s at clock %d, another at clock %d: %d empty push(es) "
                "there, so that each gradient is the same iteration on every shard",
                s.address,
                s.clock,
                top,
                top - s.clock,
            )
        while s.clock < top and not s.lost:
            try:
                push_empty(s, s.clock)
            except RejoinRequired:
                return  # marked lost: joined again, then aligned again
            s.clock += 1


def rewound(sessions: Sequence[Session]) -> ServerRewound | None:
    """What to tell the loop once servers that restarted behind this worker's pushes are
    joined again (each session's ``rewound``, cleared here): the step it goes on from and
    how many of its steps are not in the model; None if none was lost."""
    hits = [(s.address, s.rewound) for s in sessions if s.rewound is not None]
    for s in sessions:
        s.rewound = None
    if not hits:
        return None
    was, now = max(c for _, c in hits), min(s.clock for s in sessions)
    if now >= was:
        return None
    where, lost = ", ".join(a for a, _ in hits), was - now
    last = "the last one is" if lost == 1 else f"the last {lost} are"
    return ServerRewound(
        f"The server at {where} restarted from an older state: it holds {now} of this "
        f"worker's steps, not {was}, so {last} not in the model. The worker joined it "
        f"again and goes on from step {now} (worker.clock): redo your data from there.",
        now,
        was - now,
    )
