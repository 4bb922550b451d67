"""The worker's side of a table: ``TableEmbedding`` stands in for an ``nn.Embedding`` or
``nn.EmbeddingBag`` with ``sparse=True`` whose rows the servers hold.

- **Rows on demand.** A forward pass takes the distinct ids of its input, fetches the ones
  missing from the cache (one request per shard, ``client.Tables``), and computes on a copy
  of those rows that autograd treats as a leaf. So backward leaves one gradient row per
  distinct id, already coalesced: ``gradients()`` hands them to the push.
- **A bounded cache** (``RowCache``): ids to local slots, at most ``cache_rows`` rows,
  however large the table. ``prefetch(ids)`` fetches the next batch's rows ahead of time;
  a forward pass counts each distinct id found in the cache as a hit.
- **Thread-safe.** A background prefetch (the daemon's, ``worker/rows.py``) may run while
  a forward pass computes: each holds the table's lock while it uses the cache.
- **Exact blocking steps.** After a push the cache keeps only the rows prefetched since the
  previous push that this push did not touch; everything else (the rows pushed, whose
  update is on the server now, and rows fetched earlier) is fetched again when next used.
  Rows prefetched and kept may miss other workers' pushes since, as the dense weights of a
  prefetching step do: at most one step, within the policy's bound.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from paramserver.codec.rows import TableSpec
from paramserver.config import DEFAULT_CACHE_ROWS
from paramserver.errors import ConfigError
from paramserver.sparse.client import Tables
from paramserver.sparse.declared import (
    Embedding,
    RowLookup,
    coalesce,
    declared,
    name_tables,
)
from paramserver.sparse.index import RowIndex

FRESH = np.iinfo(np.int64).max  # a row read where no clock says how old: in-process tables
# A fetch of rows by id: the rows, and the slowest live clock when they were read.
Fetch = Callable[[np.ndarray], tuple[torch.Tensor, int]]


@dataclass
class CacheCounters:
    hits: int = 0  # distinct ids of a forward pass found in the cache
    misses: int = 0  # and not found (fetched then)
    fetched: int = 0  # rows fetched, prefetches included
    pushed: int = 0  # row gradients pushed
    refetched: int = 0  # prefetched rows fetched again: older than the policy's bound


class RowCache:
    """At most ``capacity`` rows of one table, by id."""

    def __init__(self, dim: int, capacity: int, dtype: torch.dtype):
        if capacity < 1:
            raise ValueError(f"A row cache holds at least one row; got {capacity}.")
        self.capacity = capacity
        self.values = torch.empty((capacity, dim), dtype=dtype)
        self.read_at = np.zeros(capacity, np.int64)  # each slot's low clock when fetched
        self.index = RowIndex(16)
        self.counters = CacheCounters()
        self._ahead: list[np.ndarray] = []  # ids prefetched since the last end_step

    def __len__(self) -> int:
        return len(self.index)

    def _keep(self, keep: np.ndarray) -> None:
        """Hold only the rows ``keep`` (a mask over ``index.items()``), compacted."""
        held, slots = self.index.items()
        rows = self.values[torch.from_numpy(slots[keep])].clone()
        read_at = self.read_at[slots[keep]]
        self.index = RowIndex(max(16, 2 * int(keep.sum())))
        new = self.index.insert(held[keep])
        self.values[torch.from_numpy(new)] = rows
        self.read_at[new] = read_at

    def slots(self, ids: np.ndarray, fetch: Fetch) -> torch.Tensor:
        """The slots of ``ids`` (distinct), fetching the rows not held (``fetch`` answers
        them and the slowest live clock when they were read); when they do not all fit,
        every other row is dropped first."""
        if len(ids) > self.capacity:
            raise ValueError(
                f"{len(ids)} distinct rows do not fit a cache of {self.capacity}; "
                "give the table a larger cache."
            )
        found = self.index.find(ids)
        missing = found < 0
        if missing.any():
            if len(self.index) + int(missing.sum()) > self.capacity:
                held, _ = self.index.items()
                self._keep(np.isin(held, ids))
                found = self.index.find(ids)
                missing = found < 0
            fresh = ids[missing]
            new = self.index.insert(fresh)
            rows, read_at = fetch(fresh)
            self.values[torch.from_numpy(new)] = rows.to(self.values.dtype)
            self.read_at[new] = read_at
            self.counters.fetched += len(fresh)
            found[missing] = new
        return torch.from_numpy(found)

    def stale(self, low: int) -> np.ndarray:
        """Drop the rows read before the slowest live clock reached ``low``; their ids."""
        held, slots = self.index.items()
        old = self.read_at[slots] < low
        if old.any():
            self._keep(~old)
            self.counters.refetched += int(old.sum())
        return held[old]

    def prefetched(self, ids: np.ndarray) -> None:
        """Note ``ids`` as fetched ahead for the next step (kept by ``end_step``)."""
        self._ahead.append(ids)

    def ahead(self) -> np.ndarray:
        """The ids fetched ahead since the last ``end_step`` (sorted, distinct)."""
        if not self._ahead:
            return np.empty(0, np.int64)
        return np.unique(np.concatenate(self._ahead))

    def end_step(self, pushed: np.ndarray, keep_ahead: bool = True) -> None:
        """A push of rows ``pushed`` went out: keep only the rows prefetched since the last
        call that it did not touch (``keep_ahead`` False: none; under ``sync`` the round
        may change any row, so rows fetched before its end are not kept)."""
        ahead, self._ahead = self._ahead, []
        if not len(self.index):
            return
        wanted = np.unique(np.concatenate(ahead)) if len(ahead) > 1 else ahead[0] if ahead else None
        if wanted is None or not keep_ahead or np.array_equal(wanted, pushed):
            # nothing fetched ahead, or only rows this push touched (the daemon's fetch of
            # the batch before its forward pass, both sorted and distinct): keep no row
            self.index = RowIndex(16)
            return
        held, _ = self.index.items()
        self._keep(np.isin(held, wanted) & ~np.isin(held, pushed))


class TableEmbedding(RowLookup):
    """An embedding (``bag`` None) or embedding bag (``bag`` its mode) over ``table``, a
    table that ``tables`` serves."""

    def __init__(
        self,
        table: str,
        tables: Tables,
        cache_rows: int = DEFAULT_CACHE_ROWS,
        bag: str | None = None,
    ):
        super().__init__()
        self.table, self.tables, self.bag = table, tables, bag
        self.spec = tables.spec(table)
        rows = min(cache_rows, self.spec.rows) if self.spec.rows else cache_rows  # no more
        try:  # allocated up front: a cache_rows past this host's memory says so, in a line
            self.cache = RowCache(self.spec.dim, rows, getattr(torch, self.spec.dtype))
        except RuntimeError as exc:  # torch's "can't allocate memory"
            raise ConfigError(
                f"--cache-rows {cache_rows}: table {table!r}'s cache of {rows} rows of "
                f"{self.spec.dim} cannot be allocated here ({str(exc).splitlines()[0]}); give "
                "fewer rows."
            ) from None
        self._used: list[tuple[np.ndarray, torch.Tensor]] = []
        self.lock = threading.Lock()  # the cache, between a forward pass and a prefetch

    def _fetch(self, ids: np.ndarray) -> tuple[torch.Tensor, int]:
        """Rows ``ids`` from the servers, and the slowest live clock when they were read
        (``FRESH`` where the tables do not say: in-process ones)."""
        pull_at = getattr(self.tables, "pull_many_at", None)
        if pull_at is None:
            return self.tables.pull(self.table, ids), FRESH
        rows, low = pull_at({self.table: ids})
        return rows[self.table], low

    def prefetch(
        self,
        ids: torch.Tensor | np.ndarray,
        fetched: tuple[np.ndarray, torch.Tensor] | None = None,
        read_at: int = -1,
    ) -> None:
        """Fetch the rows ``ids`` touch now, for a forward pass to come. ``fetched``: rows
        already pulled (sorted distinct ids, their rows), used for those it holds, read
        when the slowest live clock was ``read_at`` (-1: unknown, so as old as can be)."""
        distinct = np.unique(np.asarray(ids, dtype=np.int64))
        fetch = self._fetch if fetched is None else _served_from(fetched, read_at, self._fetch)
        with self.lock:
            self.cache.slots(distinct, fetch)
            self.cache.prefetched(distinct)

    def stale(self, low: int) -> np.ndarray:
        """Drop the cached rows read before the slowest live clock reached ``low``; their
        ids (``RowCache.stale``)."""
        with self.lock:
            return self.cache.stale(low)

    def missing(self, distinct: np.ndarray) -> np.ndarray:
        """The ids of ``distinct`` (sorted, distinct int64) that the cache does not hold."""
        with self.lock:
            return distinct[self.cache.index.find(distinct) < 0]

    @property
    def name(self) -> str:
        return self.table

    def rows_of(self, distinct: np.ndarray, device: torch.device) -> torch.Tensor:
        """From the cache, fetching what it lacks; in training, a leaf whose gradient the
        next push takes (``gradients``)."""
        with self.lock:
            before = self.cache.counters.fetched
            slots = self.cache.slots(distinct, self._fetch)
            fetched = self.cache.counters.fetched - before
            self.cache.counters.misses += fetched
            self.cache.counters.hits += len(distinct) - fetched
            rows = self.cache.values[slots].to(device)
        rows.requires_grad_(self.training)
        if self.training:
            self._used.append((distinct, rows))
        return rows

    def gradients(self) -> tuple[np.ndarray, torch.Tensor] | None:
        """The distinct ids the forward passes since the last call touched and the sum of
        their gradients (one row each), or None when no gradient reached them."""
        used, self._used = self._used, []
        used = [(ids, rows.grad) for ids, rows in used if rows.grad is not None]
        return coalesce(used) if used else None

    def push(self) -> int:
        """Push the gradients of the rows used since the last push; those rows leave the
        cache. Returns the rows pushed."""
        got = self.gradients()
        if got is None:
            return 0
        ids, grads = got
        self.tables.push(self.table, ids, grads)
        self.end_step(ids)
        return len(ids)

    def end_step(self, pushed: np.ndarray, keep_ahead: bool = True) -> None:
        """Rows ``pushed`` went to the servers: see ``RowCache.end_step``."""
        with self.lock:
            self.cache.counters.pushed += len(pushed)
            self.cache.end_step(pushed, keep_ahead)

    def forget(self) -> None:
        """Drop every cached row (and any gradient not pushed): the next forward pass
        fetches the servers' current rows, e.g. for an evaluation."""
        self._used = []
        self.end_step(np.empty(0, np.int64))


def _served_from(fetched: tuple[np.ndarray, torch.Tensor], read_at: int, fetch: Fetch) -> Fetch:
    """A fetch that takes rows from ``fetched`` (sorted ids, their rows, read when the
    slowest live clock was ``read_at``), and the rest from ``fetch``."""
    have, rows = fetched

    def serve(ids: np.ndarray) -> tuple[torch.Tensor, int]:
        pos = np.minimum(np.searchsorted(have, ids), max(len(have) - 1, 0))
        found = have[pos] == ids if len(have) else np.zeros(len(ids), bool)
        if found.all():
            return rows[torch.from_numpy(pos)], read_at
        out = torch.empty((len(ids), rows.shape[1]), dtype=rows.dtype)
        out[torch.from_numpy(found)] = rows[torch.from_numpy(pos[found])]
        rest, low = fetch(ids[~found])
        out[torch.from_numpy(~found)] = rest
        return out, min(read_at, low)

    return serve


def table_specs(model: nn.Module) -> list[TableSpec]:
    """A ``TableSpec`` for each table of ``model`` (a declared ``Embedding`` or a trainable
    sparse embedding), named by its module path, in its weight's dtype (a declared one's
    own, with its initialiser)."""
    name_tables(model)
    return [
        m.spec(name)
        if isinstance(m, Embedding)
        else TableSpec(
            name, m.num_embeddings, m.embedding_dim, str(m.weight.dtype).removeprefix("torch.")
        )
        for name, m in _sparse_embeddings(model)
    ]


def own_rows(model: nn.Module) -> dict[str, torch.Tensor]:
    """The rows each table of ``model`` starts from where the module holds them, by table
    name: a trainable sparse ``nn.Embedding`` or ``nn.EmbeddingBag``'s weight (pretrained,
    or initialised as the user chose). A declared ``Embedding`` holds no rows of its own
    (it may have 10**12): its rows are seeded, none here."""
    name_tables(model)
    return {
        name: m.weight.detach().cpu()
        for name, m in _sparse_embeddings(model)
        if not isinstance(m, Embedding)
    }


def make_tables(model: nn.Module, min_rows: int = 0, names: Iterable[str] = ()) -> list[str]:
    """Make tables of ``model``'s trainable dense embeddings that have at least ``min_rows``
    rows (0: none by size) or are named in ``names`` (the servers' tables, at join): they
    become ``sparse=True`` in place, so ``table_specs`` and ``models.parameters`` see them as
    tables. Returns their names."""
    wanted, made = set(names), []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Embedding | nn.EmbeddingBag) or m.sparse:
            continue
        chosen = name in wanted or (min_rows > 0 and m.num_embeddings >= min_rows)
        if m.weight.requires_grad and chosen:
            m.sparse = True
            made.append(name)
    return made


Table = nn.Embedding | nn.EmbeddingBag | Embedding


def _sparse_embeddings(model: nn.Module) -> list[tuple[str, Table]]:
    """The tables of ``model`` in module order: declared ones and sparse embeddings."""
    found: list[tuple[str, Table]] = list(declared(model))
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse and m.weight.requires_grad:
            unsupported = [
                what
                for what, value in (("padding_idx", m.padding_idx), ("max_norm", m.max_norm))
                if value is not None
            ]
            if isinstance(m, nn.EmbeddingBag) and m.include_last_offset:
                unsupported.append("include_last_offset")
            if unsupported:
                raise ValueError(
                    f"Embedding {name!r}: a table cannot take {', '.join(unsupported)} yet."
                )
            found.append((name, m))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(found, key=lambda pair: order[pair[0]])


def replace_tables(
    model: nn.Module, make: Callable[[str, Table, str | None], nn.Module]
) -> dict[str, nn.Module]:
    """Replace each table of ``model`` by ``make(name, module, bag mode or None)``, under
    every path the module has (a table shared by two parts of a model is one table, named
    by its first path); returns the replacements by name."""
    made: dict[str, nn.Module] = {}
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
    for name, m in _sparse_embeddings(model):
        if not name:
            raise ValueError("A sparse embedding that is the whole model: wrap it in a module.")
        bag = (
            m.bag
            if isinstance(m, Embedding)
            else (m.mode if isinstance(m, nn.EmbeddingBag) else None)
        )
        replacement = make(name, m, bag)
        for path in paths[id(m)]:
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, replacement)
        made[name] = replacement
    return made


def attach_tables(
    model: nn.Module, tables: Tables, cache_rows: int = DEFAULT_CACHE_ROWS
) -> dict[str, TableEmbedding]:
    """Replace each sparse embedding of ``model`` by a ``TableEmbedding`` of the table of
    the same name (``replace_tables``); returns them by name. The replaced modules'
    weights are freed."""

    def make(name: str, m: Table, bag: str | None) -> TableEmbedding:
        spec = tables.spec(name)
        rows = m.rows if isinstance(m, Embedding) else m.num_embeddings
        if (spec.rows, spec.dim) != (rows, m.embedding_dim):
            raise ValueError(
                f"Embedding {name!r} is {rows or 'unbounded'} x {m.embedding_dim}; "
                f"its table is {spec.rows or 'unbounded'} x {spec.dim}."
            )
        return TableEmbedding(name, tables, cache_rows, bag)

    return replace_tables(model, make)  # type: ignore[return-value]
