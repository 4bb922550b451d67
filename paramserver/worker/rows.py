"""A worker's sparse tables: the model's ``TableEmbedding``s over the servers'
rows, their prefetch, and what a step pushes of them.

- **Attach.** At join the model's sparse embeddings become ``TableEmbedding``s over
  ``RemoteTables`` (``sparse/remote.py``), each with a cache of ``cache_rows`` rows.
- **Prefetch.** ``prefetch({table: ids})`` fetches rows now, for a forward pass to come
  (a user's loop names its next batch's ids; the daemon, each batch's before its forward
  pass): the rows no cache holds, of every table in one request per shard.
  ``prefetch_later(fn)`` does it on a background thread, ``fn`` giving the ids: the
  daemon's prefetch of the next batch while this one computes (``prefetch_soon(ids)``: a
  user's loop's, ``Worker.prefetch(ids, wait=False)``). A step waits for it
  before staging its push, and rows prefetched and not pushed since are kept at most one
  step (see ``sparse/embedding.py``). Each row carries the slowest live clock when it was
  read (the pull's ``low_clock``): under ``ssp:K`` a row read before that clock reached
  ``i - K`` is fetched again before iteration i computes, so a row is never older than the
  policy allows; under ``sync`` (bound 0) none is kept across a round: they are fetched
  again after its pull (``refetch``). A
  background prefetch that fails only logs: the forward pass fetches what is missing on
  demand, and raises there.
- **Memory.** A worker with tables fixes glibc's mmap threshold (``sparse/memory.py``), so
  the large row buffers of each step do not stay in its heap.
- **A restarted server.** A row pull that meets a server that restarted or dropped this
  worker joins it again (``rejoin``, the worker's) and pulls again, in the training thread;
  a background prefetch leaves that to the forward pass. The worker then drops that step's
  work, as when a push meets a restarted server: after the rejoin its clock, and so its
  batch, may be another (a sharded run rewinds every shard to the restarted one's cut).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec.rows import RowGradients
from paramserver.sparse.embedding import DEFAULT_CACHE_ROWS, CacheCounters, TableEmbedding
from paramserver.sparse.memory import fix_mmap_threshold
from paramserver.sparse.remote import RemoteTables, attach_remote, stage_rows

log = logging.getLogger(__name__)

IdsByTable = Mapping[str, Any]


class WorkerTables:
    """The tables of ``model`` that ``manifest`` names, served by ``sessions``."""

    def __init__(
        self,
        model: nn.Module,
        manifest: pb.Manifest,
        sessions: Sequence[Any],
        rpc_timeout: float,
        cache_rows: int = DEFAULT_CACHE_ROWS,
        rejoin: Callable[[], None] | None = None,
    ):
        self._background = threading.local()
        self.modules: dict[str, TableEmbedding] = attach_remote(
            model, manifest, sessions, rpc_timeout, cache_rows, self._rejoin_hook(rejoin)
        )
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ps-rows") if self.modules else None
        if self.modules:
            fix_mmap_threshold()  # row buffers back to the system when freed (sparse/memory.py)
        self._ahead: Future[None] | None = None
        # sync: rows prefetched before a round's end are fetched again after its pull
        self.exact = False
        self._again: dict[str, np.ndarray] = {}

    def __bool__(self) -> bool:
        return bool(self.modules)

    @property
    def remote(self) -> RemoteTables:
        """Where the tables' rows come from (``sparse/remote.py``)."""
        return cast(RemoteTables, next(iter(self.modules.values())).tables)

    def _rejoin_hook(self, rejoin: Callable[[], None] | None) -> Callable[[], bool]:
        def hook() -> bool:
            if rejoin is None or getattr(self._background, "active", False):
                return False
            rejoin()
            return True

        return hook

    # --- prefetch -----------------------------------------------------------------------

    def prefetch(self, ids: IdsByTable) -> None:
        """Fetch the rows ``ids[table]`` name now, for a forward pass to come: those no cache
        holds, of every table at once (one request per shard)."""
        wanted = {name: np.unique(_host(table_ids)) for name, table_ids in ids.items()}
        self._known(wanted)
        missing = {name: self.modules[name].missing(i) for name, i in wanted.items()}
        missing = {name: m for name, m in missing.items() if len(m)}
        rows, low = self.remote.pull_many_at(missing) if missing else ({}, -1)
        for name, table_ids in wanted.items():
            got = (missing[name], rows[name]) if name in rows else None
            self.modules[name].prefetch(table_ids, got, low)

    def _known(self, ids: IdsByTable) -> None:
        for name in ids:
            if name not in self.modules:
                raise ValueError(f"No table {name!r} (tables: {', '.join(sorted(self.modules))}).")

    def prefetch_soon(self, ids: IdsByTable) -> None:
        """``prefetch(ids)`` on the background thread, its tables' names checked now: a
        user's loop names its next batch's ids before this batch computes."""
        self._known(ids)
        self.prefetch_later(lambda: ids)

    def prefetch_later(self, ids: Callable[[], IdsByTable | None]) -> None:
        """``prefetch(ids())`` on the background thread (``ids()`` None: nothing to fetch)."""
        if self._pool is None:
            return
        self.wait()

        def run() -> None:
            self._background.active = True
            try:
                wanted = ids()
                if wanted:
                    self.prefetch(wanted)
            except Exception as exc:  # noqa: BLE001 - the forward pass fetches on demand
                log.info("background row prefetch failed (%s); fetching on demand", exc)

        self._ahead = self._pool.submit(run)

    def prefetch_ahead(
        self,
        first: Future[pb.PullHeader | None] | None,
        ids_of: Callable[[list[int]], IdsByTable | None],
        later: Sequence[int] = (),
    ) -> None:
        """Once ``first`` (shard 0's prefetch of the next weights, if any) has come, fetch
        the rows of the batches its header names (``ids_of(batches)``) in the background;
        without one, those of batches ``later`` (the next step's, named already)."""
        if not self:
            return
        if first is None:
            if later:
                batches = list(later)
                self.prefetch_later(lambda: ids_of(batches))
            return

        def ids() -> IdsByTable | None:
            header = first.result()
            if header is None or header.batch < 0:
                return None
            return ids_of(list(header.batches) or [header.batch])

        self.prefetch_later(ids)

    def wait(self) -> None:
        """Wait for the background prefetch in flight, if any."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.result()

    # --- steps --------------------------------------------------------------------------

    def stage(self, shards: int) -> dict[int, tuple[RowGradients, ...]]:
        """Each shard's row gradients of this step (``stage_rows``), once the background
        prefetch has landed."""
        self.wait()
        if self.exact:
            ahead = {name: m.cache.ahead() for name, m in self.modules.items()}
            self._again = {name: ids for name, ids in ahead.items() if len(ids)}
        return stage_rows(self.modules, shards, keep_ahead=not self.exact)

    def refetch(self, clock: int = 0, bound: int | None = None) -> None:
        """Once the step's pull has come, for iteration ``clock`` under a policy of
        ``bound`` (K; None: async). Under ``sync``: the rows prefetched for the next step
        before the round ended, fetched again (the round may have changed any of them:
        another worker's push of the same row). Under ``ssp:K``: the rows read before the
        slowest live clock reached ``clock - K``, fetched again, so no row is older than
        the dense weights may be."""
        again, self._again = self._again, {}
        if bound is not None and not self.exact:
            for name, module in self.modules.items():
                old = module.stale(clock - bound)
                if len(old):
                    again[name] = old
        if again:
            self.prefetch(again)

    def forget(self) -> None:
        """Drop every table's cached rows and the gradients not pushed (a dropped step)."""
        self.wait()
        self._again = {}
        for table in self.modules.values():
            table.forget()

    @property
    def counters(self) -> CacheCounters:
        """Cache hits and misses, rows fetched and pushed, over every table."""
        total = CacheCounters()
        for t in self.modules.values():
            for f in dataclasses.fields(CacheCounters):
                setattr(total, f.name, getattr(total, f.name) + getattr(t.cache.counters, f.name))
        return total

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _host(ids: Any) -> np.ndarray:
    """Ids as a flat int64 array in host memory (from a tensor on any device, or a list)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    return np.asarray(ids, dtype=np.int64).ravel()
