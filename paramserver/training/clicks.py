"""``--dataset clicks``: a seeded synthetic click log for embedding-heavy models.

Each sample is ``FIELDS`` categorical ids, one per field (a table of ``rows`` ids each), and
a click label (0 or 1):
- Ids are Zipf-distributed: rank r of a field is drawn with probability proportional to
  ``1 / r**zipf`` over ``1..rows``, then mapped to an id by a bijection of [0, rows)
  (``(r * 2654435761 + field) mod rows``), so popular ids are spread over the table and
  its shards.
- Labels come from a hidden teacher, a factorisation machine: the logit is a bias, plus a
  weight per (field, id), plus the dot products of each pair of fields' factor vectors,
  and the label is drawn from its sigmoid. The teacher's rows are a function of (seed,
  field, id) alone (``sparse.rows.initial_rows``), so a table of any size costs nothing to
  describe, and a model can learn them only from the samples that touch them: the
  long tail is hard, as in real click logs. AUC is meaningful; ``auc`` computes it.

Samples are ``x`` int64 (N, FIELDS) and ``y`` int64 (N,); models answer two logits (no
click, click), so cross-entropy and accuracy work as for the image sets.
"""

from __future__ import annotations

import numpy as np
import torch

from paramserver.models import CLICK_FIELDS, CLICK_ROWS
from paramserver.sparse.rows import initial_rows, table_key

FIELDS, ROWS = CLICK_FIELDS, CLICK_ROWS
TRAIN, TEST = 200_000, 20_000
ZIPF = 1.05
_FACTORS = 4  # the teacher's factor dimension
_MULTIPLIER = 2654435761  # a prime: coprime to any table size below it


def ids_of_ranks(ranks: np.ndarray, field: int, rows: int) -> np.ndarray:
    """Field ``field``'s ids for ``ranks`` (0-based): a bijection of [0, rows)."""
    return (ranks.astype(np.int64) * (_MULTIPLIER % rows) + field) % rows


def zipf_ranks(rng: np.random.Generator, n: int, rows: int, zipf: float) -> np.ndarray:
    """``n`` ranks in [0, rows), rank r with probability proportional to 1 / (r + 1)**zipf."""
    cdf = np.cumsum(1.0 / np.arange(1, rows + 1, dtype=np.float64) ** zipf)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), rows - 1)


def teacher_logits(x: np.ndarray, seed: int) -> np.ndarray:
    """The hidden teacher's logit of each sample of ids ``x`` (N, fields)."""
    n, fields = x.shape
    logit = np.full(n, -1.0)
    factors = []
    for f in range(fields):
        rows = initial_rows(table_key(seed, f"teacher-{f}"), x[:, f], 1 + _FACTORS, "float64")
        logit += 0.8 * rows[:, 0]
        factors.append(rows[:, 1:] * 0.35)
    for f in range(fields):
        for g in range(f + 1, fields):
            logit += (factors[f] * factors[g]).sum(axis=1)
    return logit


def make(
    train: int = TRAIN,
    test: int = TEST,
    seed: int = 0,
    fields: int = FIELDS,
    rows: int = ROWS,
    zipf: float = ZIPF,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(train_x, train_y, test_x, test_y)`` of the click log for ``seed``."""
    if fields < 1 or rows < 2 or train < 1 or test < 1:
        raise ValueError(
            f"clicks needs fields >= 1, rows >= 2 and samples; got {fields} fields "
            f"of {rows} rows, {train} + {test} samples."
        )
    rng = np.random.default_rng(seed)
    n = train + test
    x = np.stack(
        [ids_of_ranks(zipf_ranks(rng, n, rows, zipf), f, rows) for f in range(fields)], axis=1
    )
    p = 1.0 / (1.0 + np.exp(-teacher_logits(x, seed)))
    y = (rng.random(n) < p).astype(np.int64)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    return tx[:train], ty[:train], tx[train:], ty[train:]


def auc(scores: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor) -> float:
    """The area under the ROC curve of ``scores`` for binary ``labels`` (ties count half):
    the Mann-Whitney statistic. NaN when only one class is present."""
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel().astype(bool)
    positives, negatives = int(y.sum()), int((~y).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    # the average 1-based rank of each distinct score, over its ties
    average = np.cumsum(counts) - (counts - 1) / 2.0
    ranks = average[inverse]
    return float((ranks[y].sum() - positives * (positives + 1) / 2) / (positives * negatives))
