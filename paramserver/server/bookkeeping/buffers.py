"""The model's shared buffers: each worker's latest values, and what the server keeps.

A worker pushes its buffers' values (BatchNorm's running statistics, ``num_batches_tracked``)
after its gradient. Per buffer element the server keeps the mean of the latest values of a
set of workers (the live ones under ``async`` and ``ssp:K``; the round's contributors under
``sync``) for floating-point buffers, and the largest value for integer buffers ("counts").
Pulls hand that back, so every worker goes on from the shared statistics. Pure bookkeeping:
the coordinator says whose values count and when.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from paramserver.codec.layout import Manifest


class SharedBuffers:
    """Each worker's latest values of the buffers' section of ``manifest``."""

    def __init__(self, manifest: Manifest):
        params_end = manifest.section("param")[1]
        self.size = manifest.numel - params_end
        self.floats = manifest.section("buffer")[1] - params_end  # the rest are counts
        self.latest: dict[str, np.ndarray] = {}

    def record(self, worker_id: str, values: np.ndarray) -> None:
        """Keep ``values`` (copied: the caller's buffer is reused) as ``worker_id``'s latest."""
        if values.size != self.size:
            raise ValueError(f"{values.size} buffer values for a section of {self.size}.")
        if self.size:
            self.latest[worker_id] = values.copy()

    def combine(self, workers: Iterable[str]) -> np.ndarray | None:
        """The mean (floats) and largest value (counts) of the latest values of ``workers``
        that have pushed any; None when none has."""
        rows = [self.latest[w] for w in workers if w in self.latest]
        if not rows:
            return None
        stacked = np.stack(rows)
        out = np.empty(self.size, rows[0].dtype)
        out[: self.floats] = stacked[:, : self.floats].mean(axis=0, dtype=np.float64)
        out[self.floats :] = stacked[:, self.floats :].max(axis=0)
        return out

    def keep_only(self, workers: Iterable[str]) -> None:
        """Forget the values of every worker not in ``workers`` (it left or was dropped)."""
        keep = set(workers)
        for w in [w for w in self.latest if w not in keep]:
            del self.latest[w]

    def state(self) -> dict[str, Any]:
        return {w: torch.from_numpy(v.copy()) for w, v in self.latest.items()}

    def load(self, state: dict[str, Any] | None, workers: Iterable[str]) -> None:
        """Take over a checkpoint's values (none in a checkpoint from before buffers), less
        those of workers that are no longer members."""
        keep = set(workers)
        self.latest = {w: t.numpy().copy() for w, t in (state or {}).items() if w in keep}
