"""A running run's model read from every shard, as an observer (no join, no batch taken):
``ShardReader`` pulls the dense part range by range and the tables row by row (pulls of at
most 65,536 rows), and ``model_state_dict(servers, model)`` puts them together into what
``model.load_state_dict(strict=True)`` takes, for a live sharded run as for one server.

A live run's shards are read one after another: under ``async`` and ``ssp:K`` the shards
may be at different versions meanwhile (each shard's part is its own, whole); under
``sync`` between rounds they agree. Tables larger than ``WHOLE_TABLE_BYTES``, and
unbounded declared tables, are not read whole: they are left out and said so in the log.
``launch`` reads its servers through one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
import numpy as np
import torch

from paramserver import models
from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import layout
from paramserver.codec.rows import TableSpec
from paramserver.config import Security
from paramserver.sparse.embedding import attach_tables, make_tables
from paramserver.sparse.remote import Observer, RemoteTables
from paramserver.sparse.tableset import (
    KEPT_ON_SERVERS,
    WHOLE_TABLE_BYTES,
    say_left_out,
    too_large_for_whole,
)
from paramserver.transport.channels import observe
from paramserver.transport.stub import Stub, connect

log = logging.getLogger(__name__)


class ShardReader:
    """Observer connections to every shard of a run (shard 0 first)."""

    def __init__(self, channels: Sequence[grpc.Channel], addresses: Sequence[str]):
        self.channels, self.addresses = list(channels), list(addresses)

    @classmethod
    def connect(
        cls, addresses: Sequence[str], security: Security | None = None, timeout: float = 60.0
    ) -> ShardReader:
        channels = [connect(a, timeout, security or Security()) for a in addresses]
        return cls(channels, addresses)

    def observe(self, manifest: layout.Manifest) -> tuple[pb.PullHeader, np.ndarray]:
        """The current weights, gathered from every shard (shard 0's header)."""
        itemsize = manifest.itemsize
        if len(self.channels) == 1:
            return observe(self.channels[0], manifest.total_bytes, itemsize=itemsize)
        flat = np.empty(manifest.numel, manifest.np_dtype)
        header = None
        for i, channel in enumerate(self.channels):
            lo, hi = layout.shard_range(manifest.numel, i, len(self.channels))
            h, part = observe(channel, itemsize * (hi - lo), itemsize=itemsize)
            flat[lo:hi] = part
            header = h if header is None else header
        assert header is not None
        return header, flat

    def tables(self, model: torch.nn.Module, specs: list[TableSpec]) -> RemoteTables | None:
        """The servers' tables read by an observer, in place of ``model``'s sparse
        embeddings (none: None)."""
        if not specs:
            return None
        observers = [
            Observer(Stub(c), a) for c, a in zip(self.channels, self.addresses, strict=True)
        ]
        remote = RemoteTables(observers, specs, rpc_timeout=60)
        attach_tables(model, remote)
        return remote

    def whole_tables(
        self, tables: RemoteTables | None, where: str, kept: str = KEPT_ON_SERVERS
    ) -> dict[str, torch.Tensor]:
        """``{"NAME.weight": the table}`` of each table small enough to read whole; the
        others are said in the log (``where``: what they are left out of; ``kept``: where
        their rows are)."""
        out: dict[str, torch.Tensor] = {}
        for spec in tables.specs.values() if tables is not None else ():
            why = too_large_for_whole(spec.rows, spec.dim, spec.dtype, WHOLE_TABLE_BYTES)
            if why:
                say_left_out(spec.name, where, why, kept)
                continue
            assert tables is not None
            out[f"{spec.name}.weight"] = tables.read_all(spec.name)
        return out

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def model_state_dict(
    servers: str | Sequence[str],
    model: torch.nn.Module | str,
    security: Security | None = None,
    timeout: float = 60.0,
    table_rows: int = 0,
) -> dict[str, torch.Tensor]:
    """The model of the run that ``servers`` (every shard's address, shard 0 first, or a
    comma-separated string) serve, as ``model`` (a module of the run's model, or its name,
    built with seed 0: its frozen parameters are then those) lays it out: parameters and
    buffers from every shard, and each table whole where it can be (see the module's
    note). ``table_rows``: the servers' ``--table-rows``. It joins nothing and takes no
    batch."""
    addresses = [a.strip() for a in servers.split(",")] if isinstance(servers, str) else servers
    built = models.build(model) if isinstance(model, str) else model
    make_tables(built, table_rows)  # as the servers do
    reader = ShardReader.connect(list(addresses), security, timeout)
    try:
        manifest, _ = models.state(built)
        _, flat = reader.observe(manifest)
        state = dict(built.state_dict())
        state.update(layout.state_dict(manifest, flat))
        tables = reader.tables(built, models.table_specs(built))
        state.update(reader.whole_tables(tables, "the state dict"))
        return models.with_aliases(state, models.aliases(built))  # a tied head: its trained values
    finally:
        reader.close()
