"""A sync round clipped by the norm of the whole step (``--clip-grad-norm``, issue 56 must
4): pure decisions, no lock, no I/O.

torch's ``clip_grad_norm_`` scales every gradient of the model by ``min(1, max_norm /
(norm + 1e-6))``, ``norm`` the L2 norm over all of them. A shard holds a part of the
model, and a table's rows are gradients too, so where a round's gradient spans more than
one server's dense part (a sharded run, or a model with sparse tables), the round, once
every live worker pushed, closes (``Closing``) with its part of the squared norm (its
dense mean's and its rows' means'), and waits: on one server the total is its own part;
on several, a worker asks every shard for its part, sums them in shard order and gives
every shard the total (``worker/norm_relay.py``), with which each applies the round
scaled by the same factor. Under ``ssp:K`` and ``async`` a step is one push: its worker
says its squared norm over the whole model (``PushHeader.norm_sq``: every shard's part of
the gradient, every table's rows; taken before a lossy ``--compress``), and every shard
scales the push by the same factor (``push_factor``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paramserver.codec.idle import Idle
from paramserver.codec.rows import RowGradients
from paramserver.errors import InvalidRequest

EPS = 1e-6  # torch's clip_grad_norm_


@dataclass
class Closing:
    """Round ``round``, closed and not yet applied: its mean (None: every push empty),
    its rows' means (None: none taken), its ranges without a gradient, its part of the
    step's squared norm, and its ``n`` non-empty pushes and who pushed (contributors,
    givers)."""

    round: int
    mean: np.ndarray | None
    rows: list[RowGradients] | None
    idle: Idle
    part: float
    n: int = 1
    pushed: tuple[list[str], list[str]] = ([], [])

    def round_state(self) -> dict[str, Any]:
        """The round as a checkpoint holds one that is complete and not applied (the
        ``sync_round`` and ``row_round`` of ``Arrival.state``): a server resumed from it
        closes it again (a shard's graceful stop while its round waits; cuts never hold
        one)."""
        total = None if self.mean is None else self.mean.astype(np.float64) * self.n
        return {
            "sync_round": {
                "sum": None if total is None else torch.from_numpy(total),
                "from": list(self.pushed[0]),
                "givers": list(self.pushed[1]),
                "n": self.n,
                "dtype": None if self.mean is None else self.mean.dtype.name,
                "idle": [list(r) for r in self.idle],
            },
            "row_round": {
                r.table: [(torch.from_numpy(r.ids.copy()), r.grads * self.n)]
                for r in self.rows or ()
            },
        }


def part_of(mean: np.ndarray | None, rows: Sequence[RowGradients] | None) -> float:
    """The squared L2 norm of a round's mean and its rows' means, summed in float64."""
    total = 0.0
    if mean is not None:
        flat = torch.from_numpy(mean.reshape(-1))
        total += float(torch.linalg.vector_norm(flat, dtype=torch.float64)) ** 2
    for r in rows or ():
        total += float(torch.linalg.vector_norm(r.grads, dtype=torch.float64)) ** 2
    return total


def scale(max_norm: float, total: float) -> float:
    """The factor ``clip_grad_norm_(max_norm)`` scales by, ``total`` the squared norm."""
    return min(1.0, max_norm / (math.sqrt(total) + EPS))


def check_total(total: float, part: float) -> None:
    """A total that cannot hold this shard's ``part`` is refused (a worker that lies, or
    one that summed another round's parts).

    Raises:
        InvalidRequest: it is not finite, negative, or smaller than ``part``.
    """
    if math.isinf(part) and total == math.inf:
        return  # a float64 gradient past 1e154: scaled to zero, as clip_grad_norm_ does
    if not math.isfinite(total) or total < 0 or total < part * (1 - 1e-9):
        raise InvalidRequest(
            f"A round's squared norm over every shard of {total!r} cannot hold this shard's "
            f"own part, {part!r}."
        )


def push_factor(max_norm: float, norm_sq: float | None) -> float:
    """The factor a push that says its squared norm ``norm_sq`` is scaled by.

    Raises:
        InvalidRequest: it says none (a worker that predates it), or one not finite or
            negative.
    """
    if norm_sq is None:
        raise InvalidRequest(
            "This server clips each push by its norm over the whole model (--clip-grad-norm "
            "over shards or sparse tables): the push must say it (PushHeader.norm_sq)."
        )
    if not math.isfinite(norm_sq) or norm_sq < 0:
        raise InvalidRequest(f"A push's squared norm must be finite and >= 0; got {norm_sq!r}.")
    return scale(max_norm, norm_sq)


def times(rows: list[RowGradients] | None, factor: float | None) -> list[RowGradients] | None:
    """``rows`` with their gradients multiplied by ``factor``, copied (a push's rows may be
    views of the worker's segment, which a retry sends again); as they are for None."""
    if rows is None or factor is None or factor == 1.0:
        return rows
    return [dataclasses.replace(r, grads=r.grads * factor) for r in rows]
