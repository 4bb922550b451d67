"""Model factories with sparse tables for the tests (``--model tests.sparse_models:NAME``)."""

from __future__ import annotations

import torch
from torch import nn

from paramserver import models, sparse
from paramserver.training import clicks, data

dlrm_sparse = models.dlrm_sparse  # the built-in ``dlrm-sparse``, by its test-module name


def small_clicks() -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """The click log cut to the synthetic set's size (``--dataset tests.sparse_models:
    small_clicks``): as many batches as ``--dataset synthetic``."""
    from torch.utils.data import TensorDataset

    train_x, train_y, test_x, test_y = clicks.make(train=data.SYNTHETIC_TRAIN, test=512)
    return TensorDataset(train_x, train_y), TensorDataset(test_x, test_y)


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


class Mixed(nn.Module):
    """A table, a BatchNorm (float and integer buffers), a frozen parameter and a dense
    head: what ``paramserver export`` puts back together."""

    def __init__(self, rows: int = 200, dim: int = 4):
        super().__init__()
        self.emb = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.norm = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, 2)
        self.scale = nn.Parameter(torch.rand(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x)) * self.scale)  # type: ignore[no-any-return]


def Mixed2() -> nn.Module:  # noqa: N802 - stands for the class
    """``Mixed`` with a wider table: another model's checkpoints for ``export``."""
    return Mixed(dim=6)


def MixedMoreRows() -> nn.Module:  # noqa: N802 - stands for the class
    """``Mixed`` with a table of more rows and the same dense part: another table layout."""
    return Mixed(rows=300)


def dlrm_declared() -> nn.Module:
    """The built-in DLRM with each field's table declared unbounded (``ps.sparse.Embedding``
    of any int64 id), rowwise-adagrad at 0.05, ids admitted at their second push."""
    from paramserver.sparse import Embedding, Lifecycle

    model = models.DLRM(clicks.FIELDS, clicks.ROWS)
    for f in range(len(model.tables)):
        model.tables[f] = Embedding(
            None, 16, optimizer="rowwise-adagrad", lr=0.05, lifecycle=Lifecycle(admit_after=2)
        )
    return model


class Unbounded(nn.Module):
    """A declared unbounded table (any int64 id) and a head: ``forward(ids)`` of (N, 2)."""

    def __init__(self) -> None:
        super().__init__()
        from paramserver.sparse import Embedding

        self.users = Embedding(None, 4, init="normal:0.1", optimizer="sgd", lr=0.5)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.users(x).flatten(1))


class Huge(nn.Module):
    """A declared table of 10^12 rows of 16 (64 TB whole) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.t = sparse.Embedding(10**12, 16)
        self.l = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(self.t(x))  # type: ignore[no-any-return]
