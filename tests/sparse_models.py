"""Model factories with sparse tables for the tests (``--model tests.sparse_models:NAME``)."""

from __future__ import annotations

import torch
from torch import nn

from paramserver import clicks, models


def dlrm_sparse() -> nn.Module:
    """The built-in DLRM with its embeddings as sparse tables."""
    return models.DLRM(clicks.FIELDS, clicks.ROWS, sparse=True)


class Clicky(nn.Module):
    """Two tables, ``emb`` (an embedding of each of ``fields`` ids) and ``bag`` (an
    embedding bag over them), and a dense head: the tests' smallest model with tables."""

    def __init__(self, rows: int, dim: int = 8, fields: int = 3, bag_mode: str = "sum"):
        super().__init__()
        self.fields = fields
        self.emb = nn.Embedding(rows, dim, sparse=True)
        self.bag = nn.EmbeddingBag(rows, dim, mode=bag_mode, sparse=True)
        self.head = nn.Linear(fields * dim + dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bag = self.bag(x.flatten(), torch.arange(0, x.numel(), self.fields))
        return self.head(torch.cat([self.emb(x).flatten(1), bag], 1))  # type: ignore[no-any-return]
