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
servers and workers agree; call it before training a model on its own to start from the
rows a cluster would), and a table not named yet has a name of its own (``#N``).

On its own, backward leaves each use's gradient rows; the store applies them as one step
(summed per id, as a worker's push does) before it is next read: the next forward pass, a
``state_dict``, ``.local``. ``state_dict`` holds the rows trained so far (``NAME.rows``:
rows, optimizer state, counters), and loading it restores them.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.codec.rows import DTYPES, TableSpec
from paramserver.sparse import tablestate
from paramserver.sparse.lifecycle import Lifecycle
from paramserver.sparse.optim import RowOptimizerConfig
from paramserver.sparse.rows import Init
from paramserver.sparse.table import ShardTable

LOCAL_OPTIMIZER, LOCAL_LR = "sgd", 0.01  # on its own, when none is declared
BAG_MODES = ("sum", "mean", "max")


class RowLookup(nn.Module):
    """What every table module's forward pass does, ``nn.Embedding``'s and
    ``nn.EmbeddingBag``'s interface: the input's distinct ids, their rows (``rows_of``, each
    kind its own way: local store, servers' cache, snapshot files), then the embedding or
    the bag's pooling over them."""

    bag: str | None = None

    def __init__(self) -> None:
        super().__init__()
        _leave_rows_to_eager_mode()

    @property
    def name(self) -> str:
        """The table's name, for errors."""
        raise NotImplementedError

    def rows_of(self, distinct: np.ndarray, device: torch.device) -> torch.Tensor:
        """The rows of ``distinct`` (sorted distinct int64 ids) on ``device``."""
        raise NotImplementedError

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, inverse = self._rows(ids)
        return lookup(rows, inverse, self.bag, offsets, per_sample_weights)

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``ids``' distinct ids and where each id's is. Host work (numpy ids,
        a cache, row pulls) that ``torch.compile`` leaves to eager mode: the pooling after
        it compiles (dynamo tracing into the row index failed on a numpy global)."""
        distinct, inverse = distinct_ids(ids, self.name)
        return self.rows_of(distinct, ids.device), inverse


def _leave_rows_to_eager_mode() -> None:
    """``torch.compiler.disable`` on ``RowLookup._rows``, once, when the first table is made:
    the decorator imports torch._dynamo, which took half of a server's or a worker's start
    (about 2 s of CPU on the 2-core machine) in every process, tables or none."""
    if not getattr(RowLookup._rows, "_eager", False):
        RowLookup._rows = torch.compiler.disable(RowLookup._rows)  # type: ignore[method-assign]
        RowLookup._rows._eager = True  # type: ignore[attr-defined]


class Embedding(RowLookup):
    """A table of ``num_embeddings`` rows (None: unbounded) of ``embedding_dim`` values.

    Args:
        init: the rows' initialiser: "normal" (nn.Embedding's), "normal:STD", "uniform:B",
            "uniform:LO:HI", "zeros" or "constant:V".
        optimizer: the table's own row optimizer ("sgd", "adagrad", "rowwise-adagrad",
            "sparse-adam", "adam"; None: in a cluster the one that stands for the servers' dense
            optimizer, on its own sgd), at ``lr`` (a constant rate; None: the servers' --lr
            and schedule, on its own 0.01). A server's ``--table-optimizer`` overrides both.
        lifecycle: admission, capacity, eviction and TTL of its rows (on every shard).
        dtype: float32 or float64.
        seed: the seed of the rows' initial values when trained on its own (in a cluster,
            the servers' --seed).
    """

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
        # its module path once ``name_tables`` has run; until then a name of its own, so
        # that two tables trained on their own never start from the same rows
        self.table_name = f"#{next(_UNNAMED)}"
        self._local: ShardTable | None = None
        # gradients of the forward passes since the store last stepped: applied as one
        # step (summed per id) before the store is next read, as a worker's push does
        self._pending: list[tuple[np.ndarray, torch.Tensor]] = []

    @property
    def rows(self) -> int:
        """The declared rows; 0 for an unbounded table."""
        return self.num_embeddings or 0

    def spec(self, name: str) -> TableSpec:
        dtype = str(self.dtype).removeprefix("torch.")
        return TableSpec(name, self.rows, self.embedding_dim, dtype, self.init)

    @property
    def local(self) -> ShardTable:
        """The in-process row store this table trains on when on its own, every gradient
        of the backward passes so far applied."""
        if self._local is None:
            config = RowOptimizerConfig(
                self.optimizer or LOCAL_OPTIMIZER, LOCAL_LR if self.lr is None else self.lr
            )
            self._local = ShardTable(
                self.spec(self.table_name), config, self.seed, lifecycle=self.lifecycle
            )
        if self._pending:
            pending, self._pending = self._pending, []
            self._local.push(*coalesce(pending))
        return self._local

    @property
    def name(self) -> str:
        return self.table_name

    def rows_of(self, distinct: np.ndarray, device: torch.device) -> torch.Tensor:
        """From the in-process store; in training, backward leaves their gradients for it."""
        table = self.local
        rows = table.pull(distinct).to(device)
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            pending = self._pending
            rows.register_hook(
                lambda grad: pending.append((distinct, grad.detach().to("cpu", table.values.dtype)))
            )
        return rows

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        """The rows it trained on its own (none: no key), as ``PREFIX.rows``."""
        if self._local is not None or self._pending:
            local = self.local
            if local.held:
                destination[prefix + "rows"] = tablestate.state_dict(local)

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        """``PREFIX.rows`` (what ``state_dict`` saved) restores the in-process store, rows,
        optimizer state and counters; a whole table saved as ``PREFIX.weight`` (a
        checkpoint's model_state_dict, an export) becomes its rows."""
        saved = state_dict.get(prefix + "rows")
        if saved is not None:
            self._pending = []
            tablestate.load_state_dict(self.local, saved)
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


def distinct_ids(ids: torch.Tensor, table: str) -> tuple[np.ndarray, torch.Tensor]:
    """The distinct ids of an input (sorted int64, in host memory) and, for each of its ids,
    the position of its row among them; ValueError naming ``table`` for ids that are not
    integers (as ``nn.Embedding`` refuses them)."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(
            f"Table {table!r}: ids must be integers, not {str(ids.dtype).removeprefix('torch.')}."
        )
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


def coalesce(parts: list[tuple[np.ndarray, torch.Tensor]]) -> tuple[np.ndarray, torch.Tensor]:
    """The (ids, gradient rows) of several uses of a table as distinct ids with their
    gradients summed."""
    if len(parts) == 1:
        return parts[0]
    ids = np.concatenate([i for i, _ in parts])
    unique, inverse = np.unique(ids, return_inverse=True)
    first = parts[0][1]
    total = torch.zeros((len(unique), first.shape[1]), dtype=first.dtype, device=first.device)
    total.index_add_(
        0, torch.from_numpy(inverse.reshape(-1)).to(total.device), torch.cat([g for _, g in parts])
    )
    return unique, total


_UNNAMED = itertools.count()


def declared(model: nn.Module) -> list[tuple[str, Embedding]]:
    """The declared tables of ``model``, by module path (a table under several paths: by
    its first)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Embedding)]


def name_tables(model: nn.Module) -> None:
    """Name each declared table of ``model`` by its module path (the key of its initial
    rows), as a cluster does."""
    for name, m in declared(model):
        if m.table_name != name:
            if m._pending or (m._local is not None and m._local.held):
                raise ValueError(
                    f"Table {name!r} trained on its own before its name was known (rows "
                    "start from the seed, the table's name and the id): call "
                    "paramserver.sparse.name_tables(model) before training it. A cluster "
                    "starts its tables from their initial rows, not from a model's own."
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
