"""A worker's tables over the wire: ``RemoteTables`` pulls rows from the servers that hold
them (``PullRows``, one request per shard, for one table or several at once:
``pull_many``), and ``stage_rows`` turns the gradients of a
step's ``TableEmbedding``s into each shard's part of its push header, where they ride with
the dense gradient under the same clock.

A row pull is retried while its server is unreachable, like every call of a session. A
server that restarted (or forgot the worker) marks the session lost; ``rejoin`` (the
worker's, ``worker/rows.py``) joins it again and the pull is made again. Without one (an
observer, or a background prefetch) the pull fails with the server's error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
import torch
from torch import nn

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import rows as wire
from paramserver.codec.rows import RowGradients, TableSpec
from paramserver.errors import ConfigError, RejoinRequired, from_rpc_error
from paramserver.sparse.client import split_by_shard
from paramserver.sparse.embedding import (
    DEFAULT_CACHE_ROWS,
    TableEmbedding,
    attach_tables,
    make_tables,
    table_specs,
)

T = TypeVar("T")
PULL_BYTES = 16 << 20  # a row pull's values (and ids) at most: larger go as several requests


class Observer:
    """What ``RemoteTables`` needs of a session, for a reader that is no worker (``launch``'s
    evaluation): row pulls on its stub, no id, no retries."""

    worker_id = ""
    incarnation = ""

    def __init__(self, stub: Any, address: str = "the server"):
        self.stub, self.address = stub, address

    def pull_rows(self, request: pb.RowsRequest, timeout: float | None = None) -> pb.RowsResponse:
        return self.stub.PullRows(request, timeout=timeout)  # type: ignore[no-any-return]

    def retrying(self, what: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except grpc.RpcError as err:
            raise from_rpc_error(err, f"{what} to {self.address}") from None


class RemoteTables:
    """The tables in ``specs``, served by ``sessions`` (shard i by session i). ``rejoin()``
    joins a lost session again and says whether it did (so the pull is made again)."""

    def __init__(
        self,
        sessions: Sequence[Any],
        specs: Sequence[TableSpec],
        rpc_timeout: float,
        rejoin: Callable[[], bool] | None = None,
    ):
        self.sessions = sessions
        self.specs = {s.name: s for s in specs}
        self.rpc_timeout = rpc_timeout
        self.rejoin = rejoin

    def spec(self, table: str) -> TableSpec:
        spec = self.specs.get(table)
        if spec is None:
            raise ValueError(
                f"The servers hold no table {table!r} (tables: "
                f"{', '.join(sorted(self.specs)) or 'none'})."
            )
        return spec

    def pull(self, table: str, ids: np.ndarray) -> torch.Tensor:
        return self.pull_many({table: ids})[table]

    def pull_many(self, wanted: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return self.pull_many_at(wanted)[0]

    def pull_many_at(self, wanted: Mapping[str, np.ndarray]) -> tuple[dict[str, torch.Tensor], int]:
        """The rows ``wanted[table]`` of each table: one request per shard for all of them
        (several when their values pass ``PULL_BYTES``); and the lowest ``low_clock`` the
        replies gave (the rows hold every push of the iterations below it; -1: unknown)."""
        specs = [self.spec(name) for name in wanted]
        lows: list[int] = []
        out = {
            spec.name: torch.empty((len(ids), spec.dim), dtype=getattr(torch, spec.dtype))
            for spec, ids in zip(specs, wanted.values(), strict=True)
        }
        where = {name: split_by_shard(ids, len(self.sessions)) for name, ids in wanted.items()}
        for i, s in enumerate(self.sessions):
            parts = [
                (spec, ids[where[spec.name][i]])
                for spec, ids in zip(specs, wanted.values(), strict=True)
                if len(where[spec.name][i])
            ]
            for (spec, _), rows in zip(parts, self._pull_shard(s, parts, lows), strict=True):
                out[spec.name][torch.from_numpy(where[spec.name][i])] = rows
        return out, min(lows, default=-1)

    def _pull_shard(
        self, s: Any, parts: list[tuple[TableSpec, np.ndarray]], lows: list[int]
    ) -> list[torch.Tensor]:
        """The rows of ``parts`` from one shard, in requests of at most ``PULL_BYTES`` of
        values (at least one row each), a table at most once in each."""
        requests: list[list[tuple[int, TableSpec, np.ndarray]]] = [[]]
        room = PULL_BYTES
        for k, (spec, ids) in enumerate(parts):
            # a row's values, or its id when that is larger: requests stay under PULL_BYTES too
            row = max(spec.dim * np.dtype(spec.dtype).itemsize, 8)
            lo = 0
            while lo < len(ids):
                take = room // row
                if take == 0 and requests[-1]:  # full: the next request
                    requests.append([])
                    room = PULL_BYTES
                    continue
                piece = ids[lo : lo + max(1, take)]  # a row larger than PULL_BYTES: alone
                requests[-1].append((k, spec, piece))
                room -= len(piece) * row
                lo += len(piece)
        got: list[list[torch.Tensor]] = [[] for _ in parts]
        for request in filter(None, requests):
            rows = self._pull_part(s, [(spec, ids) for _, spec, ids in request], lows)
            for (k, _, _), r in zip(request, rows, strict=True):
                got[k].append(r)
        return [g[0] if len(g) == 1 else torch.cat(g) for g in got]

    def _pull_part(
        self, s: Any, pieces: list[tuple[TableSpec, np.ndarray]], lows: list[int]
    ) -> list[torch.Tensor]:
        (first, first_ids), rest = pieces[0], pieces[1:]
        names = ", ".join(repr(spec.name) for spec, _ in pieces)

        def call() -> pb.RowsResponse:
            request = pb.RowsRequest(
                worker_id=s.worker_id,
                incarnation=s.incarnation,
                table=first.name,
                ids=wire.ids_to_bytes(first_ids),
                more=[
                    pb.TableIds(table=spec.name, ids=wire.ids_to_bytes(ids)) for spec, ids in rest
                ],
            )
            return s.pull_rows(request, timeout=self.rpc_timeout)  # type: ignore[no-any-return]

        while True:
            try:
                reply = s.retrying(f"row pull of table{'s' if rest else ''} {names}", call)
                break
            except RejoinRequired:
                if self.rejoin is None or not self.rejoin():
                    raise
        lows.append(reply.low_clock)
        values = [reply.values, *reply.more]
        if len(values) != len(pieces):
            raise ConfigError(
                f"The server at {s.address} answered a row pull of {len(pieces)} "
                f"tables with {len(values)}: is it older than this worker?"
            )
        return [
            wire.rows_from_bytes(v, len(ids), spec, "A row pull")
            for v, (spec, ids) in zip(values, pieces, strict=True)
        ]

    def read_all(self, table: str, chunk: int = 1 << 16) -> torch.Tensor:
        """The whole table (for a checkpoint), in pulls of ``chunk`` rows."""
        spec = self.spec(table)
        return torch.cat(
            [
                self.pull(table, np.arange(lo, min(lo + chunk, spec.rows)))
                for lo in range(0, spec.rows, chunk)
            ]
        )

    def push(self, table: str, ids: np.ndarray, grads: torch.Tensor) -> None:
        raise NotImplementedError("Rows are pushed with the dense gradient: Worker.step().")


def stage_rows(
    tables: dict[str, TableEmbedding], shards: int, keep_ahead: bool = True
) -> dict[int, tuple[RowGradients, ...]]:
    """Each shard's ``RowGradients`` of the rows the tables' forward passes touched
    since the last call (those rows leave the caches: the next forward fetches them after
    the push, but those prefetched since the last push and not pushed now, unless
    ``keep_ahead`` is False)."""
    by_shard: dict[int, list[RowGradients]] = {}
    for name, table in tables.items():
        got = table.gradients()
        table.end_step(got[0] if got is not None else np.empty(0, np.int64), keep_ahead)
        if got is None:
            continue
        ids, grads = got
        for i, where in enumerate(split_by_shard(ids, shards)):
            if len(where) == len(ids):  # every row is this shard's: the gradients as they are
                part = RowGradients(name, ids, grads)
            elif len(where):
                part = RowGradients(name, ids[where], grads[torch.from_numpy(where)])
            else:
                continue
            by_shard.setdefault(i, []).append(part)
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
            raise ConfigError(
                f"The model's sparse embeddings {sorted(mine)} are not the "
                f"servers' tables {sorted(t.name for t in specs)}."
            )
        if not specs:
            return {}
        return attach_tables(model, RemoteTables(sessions, specs, rpc_timeout, rejoin), cache_rows)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
