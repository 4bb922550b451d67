"""The DLRM of ``bench sparse``'s Criteo case (``stream.py``'s samples), each way it is held.

``CriteoDLRM`` (Naumov et al., 2019, as facebookresearch/dlrm's Kaggle configuration at a
smaller width): a bottom MLP 13-64-``dim`` over the ``log1p`` of the 13 counts, one table
of ``dim`` per categorical feature, the dot products of every pair of the 27 vectors (the
bottom MLP's output and the 26 embeddings, scaled by 1/sqrt(dim)), and a top MLP
(dim + 351)-128-64-2 that answers two logits (no click, click). A table reads its
feature's ids modulo its size, so a model with smaller tables takes the same samples (the
hashing trick).

``build(cards, mode)`` holds the tables as ``mode`` says:

- "declared": ``paramserver.sparse.Embedding`` declared with the row optimizer that
  ``--optimizer adam`` gives (``ROWS``: sparse-adam since issue 44, lazy adam before; lr
  ``LR``): allocated nowhere; a cluster's servers hold the rows, and on its
  own (one local process) an in-process row store trains them the same way;
- "dense": ``nn.Embedding`` dense parameters, N(0, 1): every step moves all of them;
- "small": "dense" with every table cut to at most ``SMALL_ROWS`` rows: the dense DLRM of
  the same shape (26 tables of ``dim``, the same MLPs, batch and samples) whose tables are
  small enough to be ordinary parameters.

``full`` and ``quick`` build the declared models for ``paramserver export --model``.
"""

from __future__ import annotations

import torch
from torch import nn

from paramserver.bench.criteo.stream import CARDINALITIES, DENSE, scaled
from paramserver.sparse import Embedding

LR = 0.01
ROWS = "sparse-adam"  # the tables' row optimizer: what --optimizer adam gives them
DIM = 16
SMALL_ROWS = 1024  # the small dense DLRM's tables, at most
QUICK_DIVISOR = 1000  # a quick run's cardinalities: the largest 10,131
MODES = ("declared", "dense", "small")


class CriteoDLRM(nn.Module):
    """Bottom MLP, 26 tables, pairwise dots, top MLP; input int64 (N, 13 + 26)."""

    _rows: torch.Tensor  # each table's size

    def __init__(self, tables: list[nn.Module], rows: list[int], dim: int = DIM):
        super().__init__()
        self.tables = nn.ModuleList(tables)
        self.register_buffer("_rows", torch.tensor(rows), persistent=False)
        self.bottom = nn.Sequential(nn.Linear(DENSE, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        vectors = len(tables) + 1
        self.scale = dim**-0.5
        left, right = torch.triu_indices(vectors, vectors, 1)
        self.register_buffer("_left", left, persistent=False)
        self.register_buffer("_right", right, persistent=False)
        self.top = nn.Sequential(
            nn.Linear(dim + len(left), 128),
            nn.ReLU(),
            nn.Linear(128, 64),
            nn.ReLU(),
            nn.Linear(64, 2),
        )

    def table_ids(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The ids each table looks up for input ``x`` (``Worker.prefetch`` fetches every
        table's rows in one request per shard, as the worker daemon does)."""
        ids = x[:, DENSE:] % self._rows
        return {f"tables.{f}": ids[:, f] for f in range(len(self.tables))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = self.bottom(torch.log1p(x[:, :DENSE].float()))
        ids = x[:, DENSE:] % self._rows
        e = [t(ids[:, f]) * self.scale for f, t in enumerate(self.tables)]
        v = torch.stack([dense, *e], dim=1)
        dots = torch.bmm(v, v.transpose(1, 2))[:, self._left, self._right]  # type: ignore[index]
        return self.top(torch.cat([dense, dots], dim=1))  # type: ignore[no-any-return]


def build(cards: tuple[int, ...], mode: str, dim: int = DIM, init: bool = True) -> CriteoDLRM:
    """The case's DLRM, seeded, its tables as ``mode`` says (see the module). ``init``
    False: dense tables' storage is ``torch.empty``, its pages untouched until written (a
    worker's, which the servers' weights overwrite; a model a state dict is assigned to)."""
    if mode not in MODES:
        raise ValueError(f"A Criteo table mode is one of {MODES}; got {mode!r}.")
    torch.manual_seed(0)
    rows = [min(c, SMALL_ROWS) for c in cards] if mode == "small" else list(cards)

    def table(r: int) -> nn.Module:
        if mode == "declared":
            return Embedding(r, dim, optimizer=ROWS, lr=LR)
        return nn.Embedding(r, dim) if init else nn.Embedding(r, dim, _weight=torch.empty(r, dim))

    return CriteoDLRM([table(r) for r in rows], rows, dim)


def full() -> nn.Module:
    """The declared DLRM of the Criteo Kaggle cardinalities (33.8M rows x 16)."""
    return build(CARDINALITIES, "declared")


def quick() -> nn.Module:
    """The declared DLRM of a quick run's cardinalities (a thousandth)."""
    return build(scaled(QUICK_DIVISOR), "declared")
