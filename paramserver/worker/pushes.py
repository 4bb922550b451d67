"""A push as it travels to the shards: ``StagedPush`` (a gradient copied into its slot, for
every shard), ``Landing`` (whether the shards other than 0 took it: shard 0's call waits,
since shard 0 counts its batches done) and ``Landed`` (the batches of the pushes shard 0
took, for ``--batch-log``).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import deque
from dataclasses import dataclass, field

from paramserver.codec.idle import Idle
from paramserver.codec.rows import RowGradients


@dataclass(frozen=True)
class StagedPush:
    """A gradient copied into push slot ``slot``, to be sent to every shard; shard i's copy
    is its iteration ``iterations[i]`` (the shards' clocks differ after a shard rewinds)."""

    slot: int
    iterations: tuple[int, ...]
    samples: int = 0
    loss: float = math.nan
    empty: bool = False
    rows: dict[int, tuple[RowGradients, ...]] = field(default_factory=dict)  # per shard
    row_cache: tuple[int, int] = (0, 0)  # the tables' cache hits and misses so far
    batches: tuple[int, ...] = ()  # the server-handed batches it was computed on
    idle: dict[int, Idle] = field(default_factory=dict)  # per shard: no gradient there
    norm_sq: float | None = None  # its squared norm over the whole model, where asked for

    def emptied(self) -> StagedPush:
        """The same push without its gradient (it gives its batches back)."""
        return dataclasses.replace(self, empty=True, rows={}, batches=(), idle={}, norm_sq=None)


class Landing:
    """Which shards other than 0 took one push: shard 0's call waits for all of them.

    Every ``mark`` comes from a ``finally`` of the call it reports, so the wait ends; it also
    ends when the pipeline shuts down (``closed``)."""

    def __init__(self, shards: int, closed: threading.Event):
        self._done = [threading.Event() for _ in range(shards)]
        self._took = [False] * shards
        self._closed = closed

    def mark(self, i: int, took: bool) -> None:
        if not self._done[i].is_set():
            self._took[i] = took
            self._done[i].set()

    def wait(self) -> bool:
        """Whether every shard but 0 took the push."""
        for done in self._done[1:]:
            while not done.wait(1.0):
                if self._closed.is_set():
                    return False
        return all(self._took[1:])


class Landed:
    """The batches of each push shard 0 took, oldest first, kept from the first ``take``
    on (a worker without ``--batch-log`` keeps none). A dropped push (its server
    restarted, or dropped the worker's lease while it was paused) is not among them."""

    def __init__(self) -> None:
        self._kept: deque[tuple[int, ...]] | None = None

    def took(self, staged: StagedPush) -> None:
        kept = self._kept
        if kept is not None and staged.batches and not staged.empty:
            kept.append(staged.batches)

    def take(self) -> list[tuple[int, ...]]:
        """What was taken since the last call (the first starts keeping)."""
        if self._kept is None:
            self._kept = deque()
        return [self._kept.popleft() for _ in range(len(self._kept))]
