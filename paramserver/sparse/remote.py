"""A worker's tables over the wire: ``RemoteTables`` pulls rows from the servers that hold
them (``PullRows``, one request per shard), and ``stage_rows`` turns the gradients of a
step's ``TableEmbedding``s into each shard's part of its push header, where they ride with
the dense gradient under the same clock.

A row pull is retried while its server is unreachable, like every call of a session. A
server that restarted (or forgot the worker) marks the session lost; ``rejoin`` (the
worker's, ``worker/rows.py``) joins it again and the pull is made again. Without one (an
observer, or a background prefetch) the pull fails with the server's error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
import torch
from torch import nn

from paramserver._proto import paramserver_pb2 as pb
from paramserver.errors import ConfigError, UnknownWorker, WrongIncarnation, from_rpc_error
from paramserver.sparse import wire
from paramserver.sparse.client import split_by_shard
from paramserver.sparse.embedding import (
    DEFAULT_CACHE_ROWS,
    TableEmbedding,
    attach_tables,
    make_tables,
    table_specs,
)
from paramserver.sparse.table import TableSpec
from paramserver.sparse.tableset import RowGradients

T = TypeVar("T")
PULL_BYTES = 16 << 20  # a row pull's values at most: larger pulls go as several requests


class Observer:
    """What ``RemoteTables`` needs of a session, for a reader that is no worker (``launch``'s
    evaluation): its stub, no id, no retries."""

    worker_id = ""
    incarnation = ""

    def __init__(self, stub: Any, address: str = "the server"):
        self.stub, self.address = stub, address

    def retrying(self, what: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except grpc.RpcError as err:
            raise from_rpc_error(err, f"{what} to {self.address}") from None


class RemoteTables:
    """The tables in ``specs``, served by ``sessions`` (shard i by session i). ``rejoin()``
    joins a lost session again and says whether it did (so the pull is made again)."""

    def __init__(self, sessions: Sequence[Any], specs: Sequence[TableSpec], rpc_timeout: float,
                 rejoin: Callable[[], bool] | None = None):  # fmt: skip
        self.sessions = sessions
        self.specs = {s.name: s for s in specs}
        self.rpc_timeout = rpc_timeout
        self.rejoin = rejoin

    def spec(self, table: str) -> TableSpec:
        spec = self.specs.get(table)
        if spec is None:
            raise ValueError(f"The servers hold no table {table!r} (tables: "
                             f"{', '.join(sorted(self.specs)) or 'none'}).")  # fmt: skip
        return spec

    def pull(self, table: str, ids: np.ndarray) -> torch.Tensor:
        spec = self.spec(table)
        out = torch.empty((len(ids), spec.dim), dtype=getattr(torch, spec.dtype))
        for s, where in zip(self.sessions, split_by_shard(ids, len(self.sessions)), strict=True):
            if len(where):
                out[torch.from_numpy(where)] = self._pull_shard(s, spec, ids[where])
        return out

    def _pull_shard(self, s: Any, spec: TableSpec, ids: np.ndarray) -> torch.Tensor:
        per = max(1, PULL_BYTES // (spec.dim * np.dtype(spec.dtype).itemsize))
        if len(ids) <= per:
            return self._pull_part(s, spec, ids)
        return torch.cat([self._pull_part(s, spec, ids[i : i + per])
                          for i in range(0, len(ids), per)])  # fmt: skip

    def _pull_part(self, s: Any, spec: TableSpec, ids: np.ndarray) -> torch.Tensor:
        def call() -> pb.RowsResponse:
            request = pb.RowsRequest(worker_id=s.worker_id, incarnation=s.incarnation,
                                     table=spec.name, ids=wire.ids_to_bytes(ids))  # fmt: skip
            return s.stub.PullRows(request, timeout=self.rpc_timeout)  # type: ignore[no-any-return]

        while True:
            try:
                reply = s.retrying(f"row pull of table {spec.name!r}", call)
                break
            except (WrongIncarnation, UnknownWorker):
                if self.rejoin is None or not self.rejoin():
                    raise
        return wire.rows_from_bytes(reply.values, len(ids), spec, "A row pull")

    def read_all(self, table: str, chunk: int = 1 << 16) -> torch.Tensor:
        """The whole table (for a checkpoint), in pulls of ``chunk`` rows."""
        spec = self.spec(table)
        return torch.cat([self.pull(table, np.arange(lo, min(lo + chunk, spec.rows)))
                          for lo in range(0, spec.rows, chunk)])  # fmt: skip

    def push(self, table: str, ids: np.ndarray, grads: torch.Tensor) -> None:
        raise NotImplementedError("Rows are pushed with the dense gradient: Worker.step().")


def stage_rows(tables: dict[str, TableEmbedding], shards: int) -> dict[int, tuple[Any, ...]]:
    """Each shard's ``RowGradients`` messages of the rows the tables' forward passes touched
    since the last call (those rows leave the caches: the next forward fetches them after
    the push, but those prefetched since the last push and not pushed now)."""
    by_shard: dict[int, list[pb.RowGradients]] = {}
    for name, table in tables.items():
        got = table.gradients()
        table.end_step(got[0] if got is not None else np.empty(0, np.int64))
        if got is None:
            continue
        ids, grads = got
        for i, where in enumerate(split_by_shard(ids, shards)):
            if len(where):
                part = RowGradients(name, ids[where], grads[torch.from_numpy(where)])
                by_shard.setdefault(i, []).append(wire.gradients_to_proto(part))
    return {i: tuple(msgs) for i, msgs in by_shard.items()}


def attach_remote(
    model: nn.Module,
    manifest: pb.Manifest,
    sessions: Sequence[Any],
    rpc_timeout: float,
    cache_rows: int = DEFAULT_CACHE_ROWS,
    rejoin: Callable[[], bool] | None = None,
) -> dict[str, TableEmbedding]:
    """Replace ``model``'s sparse embeddings by the tables ``manifest`` names, served by
    ``sessions``, each with a cache of ``cache_rows`` rows; none: {}.

    Raises:
        ConfigError: the model's sparse embeddings are not the servers' tables.
    """
    specs = [wire.spec_from_proto(t) for t in manifest.tables]
    try:
        make_tables(model, names=[t.name for t in specs])  # --table-rows: dense ones too
        mine = {t.name for t in table_specs(model)}
        if mine != {t.name for t in specs}:
            raise ConfigError(f"The model's sparse embeddings {sorted(mine)} are not the "
                              f"servers' tables {sorted(t.name for t in specs)}.")  # fmt: skip
        if not specs:
            return {}
        return attach_tables(model, RemoteTables(sessions, specs, rpc_timeout, rejoin), cache_rows)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
