"""What the coordinator answers a push and a pull. A pull's weights are written into the
worker's shared segment under the coordinator's lock (exactly one version's), or handed out
as a read-only snapshot that the pulls of one version share; either way they are counted,
and so is the staleness of the iteration they are for. The caller holds the lock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from paramserver.policy import staleness
from paramserver.server.bookkeeping.status import Counters


@dataclass(frozen=True)
class PushResult:
    version: int
    clock: int
    duplicate: bool


@dataclass(frozen=True)
class PullResult:
    version: int
    staleness: int
    weights: np.ndarray  # a read-only snapshot; empty when the pull's ``sink`` took them
    batches: tuple[int, ...] = ()  # the global batches to compute; none: nothing for now
    finished: bool = False  # every batch of the run is applied
    iteration: int = 0  # the iteration answered (later than asked: a late worker caught up)
    next_batches: tuple[int, ...] = ()  # asked ahead: the next iteration's, taken already

    @property
    def batch(self) -> int:
        """The first batch to compute; -1: none."""
        return self.batches[0] if self.batches else -1


class Published(Protocol):
    """A version a pull may read: the store while no apply runs, else a copy (``Frozen``)."""

    @property
    def version(self) -> int: ...
    @property
    def weights(self) -> np.ndarray: ...
    def snapshot(self) -> np.ndarray: ...


def answer(
    store: Published,
    counters: Counters,
    min_clock: int | None,
    iteration: int | None,
    batches: tuple[int, ...] = (),
    finished: bool = False,
    sink: Callable[[np.ndarray], None] | None = None,
) -> PullResult:
    """The pull's answer: ``store``'s weights for ``iteration`` (None: an observer's, or
    the end's, with no staleness to speak of), into ``sink`` when there is one."""
    if sink is None:
        weights = store.snapshot()
        counters.bytes_out += weights.nbytes
    else:
        live = store.weights
        sink(live)
        counters.bytes_out += live.nbytes
        weights = live[:0]
    lag = 0
    if iteration is not None:
        lag = staleness.staleness(iteration, min_clock)
        counters.pull(lag)
    return PullResult(store.version, lag, weights, batches, finished)
