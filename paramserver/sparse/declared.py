"""Tables declared in a user's model, never allocated: ``Embedding`` and ``EmbeddingBag``.

A declared table holds no weight. Its rows come into being where they are first pushed:

- **In a cluster**, the servers hold it as a table named by its module path (its rows
  hash-sharded, with the declared initialiser, optimizer and lifecycle), and the workers
  put a ``TableEmbedding`` in its place (``attach_tables``): a worker or a server allocates
  nothing proportional to ``num_embeddings``.
- **On its own** (plain local training, evaluation, tests) it trains on an in-process row
  store (one ``ShardTable``): a forward pass reads the rows of its ids (the initial values
  of those never pushed), and backward applies the table's optimizer to them at once, as
  TorchRec's fused embedding optimizers do. So the same model definition runs both ways;
  the dense parameters train with the user's optimizer as usual.

``num_embeddings`` None declares an unbounded table: ids are any int64 (production feature
ids, hashed to shards). The initial rows are a function of (seed, table name, id) only:
``name_tables`` names each declared table by its module path (``table_specs`` does it, so
servers and workers agree), and a table trained on its own before that is keyed by "".
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.codec.rows import DTYPES, TableSpec
from paramserver.sparse.lifecycle import Lifecycle
from paramserver.sparse.optim import RowOptimizerConfig
from paramserver.sparse.rows import Init
from paramserver.sparse.table import ShardTable

LOCAL_OPTIMIZER, LOCAL_LR = "sgd", 0.01  # on its own, when none is declared
BAG_MODES = ("sum", "mean", "max")


class Embedding(nn.Module):
    """A table of ``num_embeddings`` rows (None: unbounded) of ``embedding_dim`` values.

    Args:
        init: the rows' initialiser: "normal" (nn.Embedding's), "normal:STD", "uniform:B",
            "uniform:LO:HI", "zeros" or "constant:V".
        optimizer: the table's own row optimizer ("sgd", "adagrad", "rowwise-adagrad",
            "adam"; None: in a cluster the one that stands for the servers' dense
            optimizer, on its own sgd), at ``lr`` (a constant rate; None: the servers' --lr
            and schedule, on its own 0.01). A server's ``--table-optimizer`` overrides both.
        lifecycle: admission, capacity, eviction and TTL of its rows (on every shard).
        dtype: float32 or float64.
        seed: the seed of the rows' initial values when trained on its own (in a cluster,
            the servers' --seed).
    """

    bag: str | None = None

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        *,
        init: str = "normal",
        optimizer: str | None = None,
        lr: float | None = None,
        lifecycle: Lifecycle | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ):
        super().__init__()
        what = f"{type(self).__name__}({num_embeddings}, {embedding_dim})"
        if num_embeddings is not None and (isinstance(num_embeddings, bool) or num_embeddings < 1):
            raise ValueError(f"{what}: num_embeddings is a positive count, or None (unbounded).")
        if embedding_dim < 1:
            raise ValueError(f"{what}: embedding_dim must be at least 1.")
        if str(dtype).removeprefix("torch.") not in DTYPES:
            raise ValueError(f"{what}: dtype is one of {', '.join(DTYPES)}; got {dtype}.")
        Init.parse(init)  # ValueError now, not at the first row
        if optimizer is not None or lr is not None:
            RowOptimizerConfig(optimizer or LOCAL_OPTIMIZER, LOCAL_LR if lr is None else lr)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.init, self.optimizer, self.lr, self.dtype, self.seed = init, optimizer, lr, dtype, seed
        self.lifecycle = (lifecycle or Lifecycle()).checked(what)
        self.table_name = ""  # its module path, once ``name_tables`` has run
        self._local: ShardTable | None = None

    @property
    def rows(self) -> int:
        """The declared rows; 0 for an unbounded table."""
        return self.num_embeddings or 0

    def spec(self, name: str) -> TableSpec:
        dtype = str(self.dtype).removeprefix("torch.")
        return TableSpec(name, self.rows, self.embedding_dim, dtype, self.init)

    @property
    def local(self) -> ShardTable:
        """The in-process row store this table trains on when on its own."""
        if self._local is None:
            config = RowOptimizerConfig(
                self.optimizer or LOCAL_OPTIMIZER, LOCAL_LR if self.lr is None else self.lr
            )
            self._local = ShardTable(
                self.spec(self.table_name), config, self.seed, lifecycle=self.lifecycle
            )
        return self._local

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        distinct, inverse = distinct_ids(ids)
        table = self.local
        rows = table.pull(distinct).to(ids.device)
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            rows.register_hook(lambda grad: _apply(table, distinct, grad))
        return lookup(rows, inverse, self.bag, offsets, per_sample_weights)

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        """A whole table saved as ``PREFIX.weight`` (a checkpoint's model_state_dict, an
        export) becomes the rows of the in-process store."""
        weight = state_dict.get(prefix + "weight")
        if weight is None:
            return
        if tuple(weight.shape) != (self.rows, self.embedding_dim):
            errors.append(
                f"{prefix}weight is {tuple(weight.shape)}; the table is "
                f"{self.rows} x {self.embedding_dim}."
            )
            return
        self.local.load_rows(np.arange(self.rows, dtype=np.int64), weight.to(self.dtype))

    def extra_repr(self) -> str:
        rows = "unbounded" if self.num_embeddings is None else self.num_embeddings
        extra = f", mode={self.bag!r}" if self.bag else ""
        return f"{rows}, {self.embedding_dim}, init={self.init!r}{extra}"


class EmbeddingBag(Embedding):
    """``Embedding`` pooled per bag as ``nn.EmbeddingBag`` does: ``mode`` sum, mean or max;
    ``forward(ids, offsets=None, per_sample_weights=None)``."""

    def __init__(
        self, num_embeddings: int | None, embedding_dim: int, mode: str = "mean", **kwargs: Any
    ):
        if mode not in BAG_MODES:
            raise ValueError(f"EmbeddingBag: mode is one of {', '.join(BAG_MODES)}; got {mode!r}.")
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.bag = mode

    @property
    def mode(self) -> str:
        return self.bag or "mean"


def distinct_ids(ids: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """The distinct ids of an input (sorted int64, in host memory) and, for each of its ids,
    the position of its row among them."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    return unique.cpu().numpy().astype(np.int64, copy=False), inverse


def lookup(
    rows: torch.Tensor,
    inverse: torch.Tensor,
    bag: str | None,
    offsets: torch.Tensor | None,
    per_sample_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The output of an embedding (``bag`` None) or embedding bag over the distinct
    ``rows`` its input's ids index (``inverse``)."""
    if bag is None:
        return F.embedding(inverse, rows)
    return F.embedding_bag(inverse, rows, offsets, mode=bag, per_sample_weights=per_sample_weights)


def _apply(table: ShardTable, ids: np.ndarray, grad: torch.Tensor) -> None:
    table.push(ids, grad.detach().to("cpu", table.values.dtype))


def declared(model: nn.Module) -> list[tuple[str, Embedding]]:
    """The declared tables of ``model``, by module path."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Embedding)]


def name_tables(model: nn.Module) -> None:
    """Name each declared table of ``model`` by its module path (the key of its initial
    rows), as a cluster does."""
    for name, m in declared(model):
        if m.table_name != name:
            if m._local is not None and m._local.held:
                raise ValueError(
                    f"Table {name!r} trained on its own as {m.table_name!r}: name the "
                    "model's tables before training it."
                )
            m.table_name, m._local = name, None


def declared_choices(
    model: nn.Module,
) -> tuple[dict[str, tuple[str, float | None]], dict[str, Lifecycle]]:
    """What ``model``'s declared tables choose: the optimizers (name, lr or None) of those
    that declare one, and every one's lifecycle."""
    optimizers = {
        name: (m.optimizer or "", m.lr)
        for name, m in declared(model)
        if m.optimizer is not None or m.lr is not None
    }
    return optimizers, {name: m.lifecycle for name, m in declared(model)}
