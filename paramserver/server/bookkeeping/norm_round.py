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
scaled by the same factor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paramserver.codec.idle import Idle
from paramserver.codec.rows import RowGradients
from paramserver.errors import InvalidRequest

EPS = 1e-6  # torch's clip_grad_norm_


@dataclass
class Closing:
    """Round ``round``, closed and not yet applied: its mean (None: every push empty),
    its rows' means (None: none taken), its ranges without a gradient and its part of the
    step's squared norm."""

    round: int
    mean: np.ndarray | None
    rows: list[RowGradients] | None
    idle: Idle
    part: float


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
    if not math.isfinite(total) or total < 0 or total < part * (1 - 1e-9):
        raise InvalidRequest(
            f"A round's squared norm over every shard of {total!r} cannot hold this shard's "
            f"own part, {part!r}."
        )


def scaled(rows: list[RowGradients] | None, factor: float) -> list[RowGradients] | None:
    """``rows`` with their gradients multiplied by ``factor`` (in place: a round's means are
    its own)."""
    if factor != 1.0:
        for r in rows or ():
            r.grads.mul_(factor)
    return rows
