"""The sync round in progress: the gradients of this round's contributors, summed.

Pure bookkeeping: the sync strategy (``Rounds``, ``server/engine/arrival.py``) decides when a
round is complete (every live worker has pushed) and applies the mean.

A float32 model's round is summed in float64: the sum of a round's few float32 gradients is
then exact (unless their magnitudes lie 2**29 apart), so the mean does not depend on the
order the pushes arrived in. Summed in float32, (a + b) + c and (a + c) + b differ in the
last bit now and then, and Adam grows such bits: a seeded chaos run and the same run
uninterrupted ended 1e-5 apart once in CI.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paramserver.codec.idle import Idle, common
from paramserver.policy import staleness


def _summed_in(dtype: np.dtype) -> np.dtype:
    """The type a round of gradients of ``dtype`` is summed in: float64 for narrower floats."""
    return np.dtype(np.float64) if dtype.itemsize < 8 else dtype


class SyncRound:
    """Gradients of the current round: their sum, who pushed, and how many were non-empty."""

    def __init__(self) -> None:
        self.sum: np.ndarray | None = None  # in ``_summed_in`` the gradients' type
        self.contributors: set[str] = set()
        self.givers: set[str] = set()  # the contributors of non-empty gradients
        self.n = 0  # non-empty gradients in the sum
        self.dtype: np.dtype | None = None  # the gradients' own type
        # the parameters no push of the round had a gradient of (None: no push yet)
        self.idle: Idle | None = None
        # the last round's buffers, for the next one's: its sum, and its mean's
        self._spare: np.ndarray | None = None
        self._out: np.ndarray | None = None

    def add(self, worker_id: str, grad: np.ndarray | None, idle: Idle = ()) -> None:
        """Count ``worker_id`` in the round; an empty push (None) adds no gradient. The sum
        is kept as gradients arrive, in one buffer that every round reuses. ``idle``: the
        push's parameters without a gradient."""
        if grad is not None:
            self.idle = common(self.idle, idle)
            wide = _summed_in(grad.dtype)
            if self.sum is not None:
                self.sum += grad
            elif (
                self._spare is not None
                and self._spare.shape == grad.shape
                and self._spare.dtype == wide
            ):
                self.sum = self._spare
                np.copyto(self.sum, grad)
            else:
                self.sum = grad.astype(wide)
            if self.dtype is None:
                self.dtype = grad.dtype
            self.n += 1
            self.givers.add(worker_id)
        self.contributors.add(worker_id)

    def complete(self, live: list[str], backups: int = 0) -> bool:
        """Whether every live worker (all but ``backups``) has pushed, and someone has."""
        return staleness.round_complete(self.contributors, live, backups, self.givers)

    def take_mean(self) -> np.ndarray | None:
        """The mean gradient of the round in the gradients' type (None if every push was
        empty), in a buffer that the next round's mean reuses: apply it before the next
        round is taken. Starts the next round."""
        mean, out = None, self._out
        if self.sum is not None:
            np.divide(self.sum, self.n, out=self.sum)
            kind = self.dtype or self.sum.dtype
            if kind == self.sum.dtype:
                mean = self.sum
            else:
                if out is None or out.shape != self.sum.shape or out.dtype != kind:
                    out = np.empty(self.sum.shape, kind)
                mean = out
                np.copyto(mean, self.sum, casting="same_kind")
        spare = self.sum if self.sum is not None else self._spare
        self.__init__()  # type: ignore[misc]
        self._spare, self._out = spare, out
        return mean

    def state(self) -> dict[str, Any]:
        return {
            "sum": None if self.sum is None else torch.from_numpy(self.sum.copy()),
            "from": sorted(self.contributors),
            "givers": sorted(self.givers),
            "n": self.n,
            "dtype": None if self.dtype is None else self.dtype.name,
            "idle": None if self.idle is None else [list(r) for r in self.idle],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], live: list[str]) -> SyncRound:
        """The round of a checkpoint, less the contributors that are no longer members."""
        r = cls()
        if state["from"]:
            if state["sum"] is not None:
                saved = state["sum"].numpy()  # float64, or a float32 of an older checkpoint
                r.sum = saved.astype(_summed_in(saved.dtype))
                r.dtype = np.dtype(state.get("dtype") or saved.dtype)
            r.contributors = set(state["from"]) & set(live)
            r.givers = set(state.get("givers", ())) & set(live)
            r.n = int(state["n"])
            idle = state.get("idle")  # older checkpoints: every parameter had a gradient
            if idle is not None:
                r.idle = tuple((int(a), int(b)) for a, b in idle)
            elif r.n:
                r.idle = ()
        return r
