"""The staleness policies as pure decisions: no gRPC, no threads, no clocks of their own.

One engine serves three named policies. Each worker w has a clock c_w (the iteration it
computes next, i.e. the number of its pushes accepted plus its starting clock) and the
server has a version v (optimizer steps applied).

* ``sync``: one gradient per live worker for iteration t is averaged into one step; a pull
  for iteration t is answered once step t - 1 is applied (v >= t, in the rounds counted
  from the run's start). With B backup workers a round closes once all live workers but B
  have pushed, and a gradient that arrives after its round closed is dropped (``late``).
* ``ssp:K`` (``delay-1`` is ``ssp:1``): pushes are applied as they arrive; a pull for
  iteration t is answered once every live worker's clock is >= t - K.
* ``async``: K is infinite; pulls are answered at once.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection
from dataclasses import dataclass

from paramserver.errors import ConfigError, OutOfOrder

_SSP = re.compile(r"^(?:ssp:|delay-)([0-9]+)$")


class PushAction(enum.Enum):
    """What the server does with a push for iteration t from a worker at clock c."""

    APPLY = "apply"  # t == c: new work
    DUPLICATE = "duplicate"  # c - window <= t < c: already applied (a retry); acknowledge only
    PAST = "past"  # t < c - window: older than any retry can be; reject
    AHEAD = "ahead"  # t > c: the worker skipped iterations; reject


@dataclass(frozen=True)
class Policy:
    """A staleness policy: ``bound`` is K (0 for sync, None for async)."""

    bound: int | None

    @classmethod
    def parse(cls, text: str) -> Policy:
        """Parse ``sync``, ``async``, ``delay-K`` or ``ssp:K`` (K >= 1).

        Raises:
            ConfigError: the text names no policy.
        """
        t = text.strip().lower()
        if t == "sync":
            return cls(0)
        if t == "async":
            return cls(None)
        m = _SSP.match(t)
        if m and int(m.group(1)) >= 1:
            return cls(int(m.group(1)))
        raise ConfigError(
            f"Unknown staleness policy (--policy) {text!r}: use 'sync', 'async', 'delay-1' or 'ssp:K' "
            "with K >= 1."
        )

    @property
    def name(self) -> str:
        """The canonical name: ``sync``, ``ssp:K`` or ``async``."""
        if self.bound is None:
            return "async"
        return "sync" if self.bound == 0 else f"ssp:{self.bound}"

    @classmethod
    def label(cls, text: str) -> str:
        """The policy as the user named it, with its canonical name where they differ:
        ``delay-1 (ssp:1)``; ``ssp:3``, ``sync`` and ``async`` as they are."""
        given, name = text.strip().lower(), cls.parse(text).name
        return name if given == name else f"{given} ({name})"

    @property
    def synchronous(self) -> bool:
        """Whether gradients are averaged in rounds instead of applied on arrival."""
        return self.bound == 0

    def pull_ready(self, iteration: int, min_clock: int | None, rounds_done: int) -> bool:
        """Whether a pull for ``iteration`` may be answered now.

        Args:
            iteration: the iteration the puller is about to compute.
            min_clock: the smallest clock among live workers (None when none is live).
            rounds_done: sync rounds applied (sync only).
        """
        if self.bound is None:
            return True
        if self.bound == 0:
            return rounds_done >= iteration
        return min_clock is None or min_clock >= iteration - self.bound

    def max_inflight_pushes(self) -> int:
        """How many of its own pushes a worker may have in flight while it computes."""
        if self.bound is None:
            return 2
        return max(1, min(self.bound, 2))


def staleness(iteration: int, min_clock: int | None) -> int:
    """t - min(live clocks), floored at 0: how many iterations of someone's work are missing."""
    if min_clock is None:
        return 0
    return max(0, iteration - min_clock)


def push_action(iteration: int, clock: int, window: int = 1) -> PushAction:
    """Decide what a push for ``iteration`` from a worker whose clock is ``clock`` does.

    ``window``: how many of its own pushes a worker may have in flight, so how far back a
    retried push can be.
    """
    if iteration == clock:
        return PushAction.APPLY
    if iteration > clock:
        return PushAction.AHEAD
    return PushAction.DUPLICATE if iteration >= clock - window else PushAction.PAST


def round_complete(
    contributors: Collection[str],
    live: Collection[str],
    backups: int = 0,
    givers: Collection[str] = (),
) -> bool:
    """A sync round is complete when every live worker has contributed (and someone has),
    or with ``backups`` B, when all live workers but B have given a gradient (``givers``:
    empty pushes, at the run's end, do not close a round early: they wait for everyone,
    so the last batches are not left to a straggler's late push)."""
    if not contributors:
        return False
    if all(w in contributors for w in live):
        return True
    gave = sum(1 for w in live if w in givers)
    return backups > 0 and gave >= max(1, len(live) - backups)


def late(iteration: int, rounds_done: int) -> bool:
    """Under sync, whether a push for ``iteration`` comes after its round closed without it
    (round t takes the pushes of iteration t): only backup workers let that happen."""
    return iteration < rounds_done


def check_pull_iteration(worker_id: str, iteration: int, clock: int, window: int) -> None:
    """A worker may pull the iteration of its clock, or up to ``window`` past it (its pushes
    in flight); any other is OutOfOrder. An iteration below its clock is one it pushed
    already: the batches such a pull took could never be pushed, and the run would stall
    on them (issue 55)."""
    if iteration > clock + window:
        raise OutOfOrder(
            f"Worker {worker_id} asked for iteration {iteration} but its clock is {clock}."
        )
    if iteration < clock:
        raise OutOfOrder(
            f"Worker {worker_id} asked for iteration {iteration}, which it pushed already: "
            f"its clock is {clock}."
        )
