"""The faults ``paramserver chaos`` injects, and their seeded schedule: pure decisions, no
processes (``cluster/chaos.py`` carries them out).

Kinds:
    kill-worker      kill -9 of a worker, which starts again (a new process joins);
    stop-worker      SIGSTOP of a worker for longer than its lease, then SIGCONT (it was
                     dropped, and joins again);
    kill-shard       kill -9 of one server shard, which starts again from its newest cut
                     (the other shard rewinds to it);
    kill-all-shards  kill -9 of every shard at once, all started again;
    stop-shard       SIGSTOP of one shard for a few seconds (a long GC pause, a swapped
                     host), then SIGCONT;
    disk-full        one shard's checkpoint writes fail for a few seconds (a file-size limit
                     set on the running process, as a full disk), then succeed again;
    link-down        a worker's network link down for half its lease to twice it, then up
                     again (its calls time out or fail; past its lease it is dropped and
                     joins again); the chaos run then puts every worker in a network
                     namespace of its own (root and iproute2: ``cluster/netns.py``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

KINDS = (
    "kill-worker",
    "stop-worker",
    "kill-shard",
    "kill-all-shards",
    "stop-shard",
    "disk-full",
    "link-down",
)
WORKER_KINDS = frozenset({"kill-worker", "stop-worker", "link-down"})  # the workers' side
DRIFT = 16  # steps a fault: how far past its point the run is when it is injected
# (the status polls are slow while the host is busy: 15 steps past on the 2-core machine)
HOLD_RATE = 12  # steps a second the run makes while a fault holds: 42 in a worker's 5.1 s
# link-down and 38 in another's 4.5 s stop on the 2-core machine (none in the first 3 s,
# the lease; about 19 a second after, with two workers)
RESTART = 2.0  # seconds of a shard's restart to count as a hold: 22 steps went by from a
# shard's kill to the next fault's point on the 2-core machine


@dataclass(frozen=True)
class Fault:
    """One fault: its kind, which process (a worker's or a shard's index; -1: every
    shard) and how long it holds (SIGSTOP, a failing disk), in seconds."""

    kind: str
    target: int
    hold: float = 0.0

    def __str__(self) -> str:
        who = (
            "every shard"
            if self.target < 0
            else f"{'worker' if self.kind in WORKER_KINDS else 'shard'} {self.target}"
        )
        held = f" for {self.hold:.1f}s" if self.hold else ""
        return f"{self.kind} of {who}{held}"


def parse_kinds(text: str) -> tuple[str, ...]:
    """``--kinds``: comma-separated kinds, or "all"; "server" for the server-side ones.

    Raises:
        ValueError: an unknown kind.
    """
    words = [w.strip() for w in text.split(",") if w.strip()]
    out: list[str] = []
    for word in words or ["all"]:
        if word == "all":
            out += KINDS
        elif word == "server":
            out += [k for k in KINDS if k not in WORKER_KINDS]
        elif word in KINDS:
            out.append(word)
        else:
            raise ValueError(
                f"Unknown fault kind {word!r}: choose among {', '.join(KINDS)}, all or server."
            )
    return tuple(dict.fromkeys(out))


def schedule(
    seed: int, count: int, kinds: tuple[str, ...], shards: int, workers: int, lease: float
) -> list[Fault]:
    """``count`` faults drawn from ``kinds`` with ``seed``: every kind once before any
    twice (in a seeded order), each on a seeded target; stops outlast a worker's ``lease``
    by half of it, a shard's pause or failing disk holds 2 to 4 seconds, and a link is
    down for half the lease to twice it (either side of the lease)."""
    rng = random.Random(seed)
    out: list[Fault] = []
    while len(out) < count:
        order = list(kinds)
        rng.shuffle(order)
        for kind in order[: count - len(out)]:
            if kind in WORKER_KINDS:
                target = rng.randrange(workers)
            elif kind == "kill-all-shards":
                target = -1
            else:
                target = rng.randrange(shards)
            hold = 0.0
            if kind == "stop-worker":
                hold = round(lease * 1.5, 1)
            elif kind in ("stop-shard", "disk-full"):
                hold = round(rng.uniform(2.0, 4.0), 1)
            elif kind == "link-down":
                hold = round(rng.uniform(0.5, 2.0) * lease, 1)
            out.append(Fault(kind, target, hold))
    return out


def room(fault: Fault, gap: int) -> int:
    """The run's steps ``fault`` takes up: ``gap`` (the progress between two faults, a cut's
    worth for a rewind and one past it: the next fault waits for a cut after this one's
    recovery), ``DRIFT`` for the polling of progress, and what the run makes while the
    fault holds (``HOLD_RATE``; a shard's restart counts as ``RESTART`` seconds of it)."""
    busy = RESTART if fault.kind in ("kill-shard", "kill-all-shards") else fault.hold
    return gap + DRIFT + math.ceil(busy * HOLD_RATE)


def points(faults: list[Fault], gap: int) -> list[int]:
    """The step at which each fault is due: each after the room the ones before it take up
    (so a fault that holds long does not push the later ones past the run's end: the
    seed-2 soak lost its fourth fault that way when each took a fixed room)."""
    out, at = [], gap
    for fault in faults:
        out.append(at)
        at += room(fault, gap)
    return out
