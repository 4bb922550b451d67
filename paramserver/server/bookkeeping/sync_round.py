"""The sync round in progress: the gradients of this round's contributors, summed.

Pure bookkeeping: the sync strategy (``Rounds``, ``server/engine/arrival.py``) decides when a
round is complete (every live worker has pushed) and applies the mean.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paramserver.policy import staleness


class SyncRound:
    """Gradients of the current round: their sum, who pushed, and how many were non-empty."""

    def __init__(self) -> None:
        self.sum: np.ndarray | None = None
        self.contributors: set[str] = set()
        self.givers: set[str] = set()  # the contributors of non-empty gradients
        self.n = 0  # non-empty gradients in the sum
        self._spare: np.ndarray | None = None  # the last round's sum, for the next one's

    def add(self, worker_id: str, grad: np.ndarray | None) -> None:
        """Count ``worker_id`` in the round; an empty push (None) adds no gradient. The sum
        is kept as gradients arrive, in one buffer that every round reuses."""
        if grad is not None:
            if self.sum is not None:
                self.sum += grad
            elif self._spare is not None and self._spare.shape == grad.shape:
                self.sum = self._spare
                np.copyto(self.sum, grad)
            else:
                self.sum = grad.copy()
            self.n += 1
            self.givers.add(worker_id)
        self.contributors.add(worker_id)

    def complete(self, live: list[str], backups: int = 0) -> bool:
        """Whether every live worker (all but ``backups``) has pushed, and someone has."""
        return staleness.round_complete(self.contributors, live, backups, self.givers)

    def take_mean(self) -> np.ndarray | None:
        """The mean gradient of the round (None if every push was empty), divided in place
        in the round's buffer, which the next round's sum reuses: apply it before another
        gradient is added. Starts the next round."""
        mean = None if self.sum is None else np.divide(self.sum, self.n, out=self.sum)
        spare = self.sum if self.sum is not None else self._spare
        self.__init__()  # type: ignore[misc]
        self._spare = spare
        return mean

    def state(self) -> dict[str, Any]:
        return {
            "sum": None if self.sum is None else torch.from_numpy(self.sum.copy()),
            "from": sorted(self.contributors),
            "givers": sorted(self.givers),
            "n": self.n,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], live: list[str]) -> SyncRound:
        """The round of a checkpoint, less the contributors that are no longer members."""
        r = cls()
        if state["from"]:
            r.sum = None if state["sum"] is None else state["sum"].numpy().copy()
            r.contributors = set(state["from"]) & set(live)
            r.givers = set(state.get("givers", ())) & set(live)
            r.n = int(state["n"])
        return r
