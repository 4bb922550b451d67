"""Model factories with sparse tables for the tests (``--model tests.sparse_models:NAME``)."""

from __future__ import annotations

from torch import nn

from paramserver import clicks, models


def dlrm_sparse() -> nn.Module:
    """The built-in DLRM with its embeddings as sparse tables."""
    return models.DLRM(clicks.FIELDS, clicks.ROWS, sparse=True)
