"""A Criteo-like synthetic click stream for ``bench sparse``'s recommender case.

The shape of the Criteo Kaggle Display Advertising Challenge set, which cannot be had here:

- **26 categorical features** with its public cardinalities (``CARDINALITIES``: the counts
  DLRM implementations size its tables by, TorchRec's ``KAGGLE_NUM_EMBEDDINGS_PER_FEATURE``
  and the MLPerf DLRM reference's Kaggle ``ln_emb``; the largest 10,131,227, 33.8M ids in
  all). Each feature's ids are Zipf(``ZIPF``)-distributed over its cardinality: rank r
  drawn with probability about proportional to ``1 / r**ZIPF`` (the continuous inverse
  CDF, so a 10M-id feature needs no table of 10M probabilities), mapped to an id by a
  bijection of [0, cardinality) (``clicks.ids_of_ranks``), so popular ids spread over the
  table and its shards;
- **13 dense features**: integer counts, as Criteo's I1..I13, ``floor(exp(mu + sigma * z))``
  of a latent normal ``z`` (a model reads them as ``log1p``);
- **labels from a hidden model**: the logit is a bias, plus a weight per (feature, id),
  plus the dot products of every pair of features' factor vectors (a factorisation
  machine), plus a linear function of the dense features' latents; the label is drawn
  from its sigmoid (about 26% clicks, as Criteo's 25.6%). The hidden rows are a hash of
  (seed, feature, id) (``sparse.rows.initial_rows``): no 10M-row table exists anywhere,
  and only samples that touch an id tell a model its weight. AUC means something.

Samples are ``x`` int64 (N, 39): the 13 counts, then the 26 ids; ``y`` int64 (N,) clicks.
They are made a chunk of ``CHUNK`` at a time, each chunk from its own generator seeded by
(seed, stream, chunk), so any prefix of the stream is the same whatever is asked for.
"""

from __future__ import annotations

import numpy as np
import torch

from paramserver.sparse.rows import initial_rows, table_key
from paramserver.training.clicks import ids_of_ranks

# Criteo Kaggle (Display Advertising Challenge), C1..C26: the ids per feature that DLRM
# implementations size its tables by (TorchRec's KAGGLE_NUM_EMBEDDINGS_PER_FEATURE)
CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
DENSE = 13
ZIPF = 1.05
CHUNK = 1 << 16
_FACTORS = 4  # the hidden model's factor dimension
_WEIGHT, _FACTOR, _DENSE_WEIGHT, _BIAS = 0.3, 0.15, 0.15, -1.6


def scaled(divisor: int) -> tuple[int, ...]:
    """The cardinalities divided by ``divisor`` (at least 2 ids each): a quick run's."""
    return tuple(max(2, c // divisor) for c in CARDINALITIES)


def zipf_ranks(rng: np.random.Generator, n: int, rows: int, zipf: float = ZIPF) -> np.ndarray:
    """``n`` ranks in [0, rows), rank r with density about proportional to (r + 1)**-zipf:
    the inverse CDF of x**-zipf on [1, rows + 1), floored (``zipf`` != 1)."""
    top = (rows + 1.0) ** (1.0 - zipf)
    x = (1.0 + rng.random(n) * (top - 1.0)) ** (1.0 / (1.0 - zipf))
    return np.minimum(x.astype(np.int64) - 1, rows - 1)


def _hidden(seed: int, name: str, ids: np.ndarray, dim: int) -> np.ndarray:
    return initial_rows(table_key(seed, f"criteo-{name}"), ids, dim, "float64")


def hidden_logits(ids: np.ndarray, latent: np.ndarray, seed: int) -> np.ndarray:
    """The hidden model's logit for ids (N, 26) and the dense features' latents (N, 13)."""
    logit = np.full(len(ids), _BIAS)
    factors = np.zeros((len(ids), _FACTORS))
    squares = np.zeros(len(ids))
    for f in range(ids.shape[1]):
        rows = _hidden(seed, f"c{f}", ids[:, f], 1 + _FACTORS)
        logit += _WEIGHT * rows[:, 0]
        v = rows[:, 1:] * _FACTOR
        factors += v
        squares += (v * v).sum(axis=1)
    logit += 0.5 * ((factors * factors).sum(axis=1) - squares)  # every pair's dot product
    weights = _hidden(seed, "dense", np.arange(1), DENSE)[0]
    return logit + _DENSE_WEIGHT * latent @ weights  # type: ignore[no-any-return]


def chunk(
    seed: int, stream: int, index: int, n: int, cards: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Chunk ``index`` of stream ``stream`` (0 train, 1 test): its first ``n`` samples."""
    rng = np.random.default_rng([seed, stream, index])
    ids = np.stack(
        [ids_of_ranks(zipf_ranks(rng, CHUNK, c), f, c) for f, c in enumerate(cards)], axis=1
    )
    latent = rng.standard_normal((CHUNK, DENSE))
    shape = _hidden(seed, "counts", np.arange(2), DENSE)  # each count's mu and sigma
    mu, sigma = 1.5 + np.abs(shape[0]), 0.6 + 0.4 * np.abs(shape[1])
    counts = np.floor(np.exp(mu + sigma * latent)).astype(np.int64)
    p = 1.0 / (1.0 + np.exp(-hidden_logits(ids, latent, seed)))
    y = (rng.random(CHUNK) < p).astype(np.int64)
    return np.concatenate([counts, ids], axis=1)[:n], y[:n]


def samples(
    n: int, seed: int = 0, cards: tuple[int, ...] = CARDINALITIES, stream: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` samples of ``stream``: ``x`` int64 (n, 39), ``y`` int64 (n,)."""
    parts = [
        chunk(seed, stream, i, min(CHUNK, n - lo), cards) for i, lo in enumerate(range(0, n, CHUNK))
    ]
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    return torch.from_numpy(x), torch.from_numpy(y)


def make(
    train: int, test: int, seed: int = 0, cards: tuple[int, ...] = CARDINALITIES
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(train_x, train_y, test_x, test_y)``: the train stream's first ``train`` samples
    and the test stream's first ``test``."""
    return (*samples(train, seed, cards, 0), *samples(test, seed, cards, 1))
