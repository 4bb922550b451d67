"""Every table one server shard holds, as the coordinator will use them: decisions and
bookkeeping only, no I/O.

- ``TableSet``: the shard's ``ShardTable`` of each table. A push's row gradients (any
  number of tables) are checked whole by ``check`` before ``apply`` changes anything, so a
  push with one bad table, or a bad dense part, changes nothing.
- The sync round's row gradients: ``sparse/row_round.py``.
- ``row_optimizer``: the tables' optimizer for the server's ``--optimizer``: adam and
  adamw give sparse-adam (weight decay is not applied to rows), sgd and momentum give sgd,
  at the same learning rate and schedule (the coordinator passes each step's rate to
  ``apply``); ``table_optimizers`` gives each table its own where ``--table-optimizer``
  names one (with its own learning rate, the table keeps it: no schedule).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paramserver.codec.rows import RowGradients, TableSpec
from paramserver.errors import ConfigError, InvalidRequest
from paramserver.sparse import tablestate
from paramserver.sparse.initial import Recent
from paramserver.sparse.lifecycle import Lifecycle
from paramserver.sparse.optim import RowOptimizerConfig
from paramserver.sparse.rows import Init, initial_rows, shard_of
from paramserver.sparse.table import Lookup, Prepared, ShardTable, complete_all, prepare_all
from paramserver.sparse.tablestate import TableChanges

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checked(RowGradients):
    """A push's rows of one table as ``TableSet.check`` passed them, with the initial values
    of those not held then (computed outside the coordinator's lock: ``ShardTable.prepare``)."""

    prepared: Prepared | None = None


def row_optimizer(name: str, lr: float) -> RowOptimizerConfig:
    """The tables' optimizer for the server's ``--optimizer name`` and ``--lr``."""
    by_server = {
        "adam": "sparse-adam",
        "adamw": "sparse-adam",
        "sgd": "sgd",
        "momentum": "sgd",
        "nesterov": "sgd",
        "delayed-nesterov": "sgd",
    }
    rows = by_server.get(name)
    if rows is None:
        raise ValueError(f"No row-wise optimizer stands for {name!r}.")
    return RowOptimizerConfig(rows, lr)


# A table's optimizer, and whether it follows the server's learning-rate schedule.
Chosen = tuple[RowOptimizerConfig, bool]


def table_optimizers(
    specs: Sequence[TableSpec],
    chosen: Mapping[str, tuple[str, float | None]],
    dense: str,
    lr: float,
    declared: Mapping[str, tuple[str, float | None]] | None = None,
) -> dict[str, Chosen]:
    """Each table's optimizer: the one ``chosen`` names for it (``--table-optimizer``,
    parsed; "" for the tables it does not name), else the one the model ``declared`` for
    it (``declared.Embedding``; its name "": the dense one's at its own rate), else the
    one that stands for the server's ``dense`` optimizer. Its own learning rate keeps it
    constant; without one it is ``lr`` on the server's schedule.

    Raises:
        ConfigError: ``chosen`` names a table the model does not have.
    """
    names = [s.name for s in specs]
    unknown = sorted(set(chosen) - set(names) - {""})
    if unknown:
        raise ConfigError(
            f"--table-optimizer names {', '.join(map(repr, unknown))}, which the model does "
            f"not hold as a sparse table (tables: {', '.join(names) or 'none'})."
        )
    out: dict[str, Chosen] = {}
    for name in names:
        pick = chosen.get(name, chosen.get("")) or (declared or {}).get(name)
        if pick is None:
            out[name] = (row_optimizer(dense, lr), True)
        else:
            kind = pick[0] or row_optimizer(dense, lr).name
            out[name] = (RowOptimizerConfig(kind, pick[1] or lr), pick[1] is None)
    return out


class TableSet:
    """Shard ``shard`` of ``shards`` of every table in ``specs``."""

    def __init__(
        self,
        specs: Sequence[TableSpec],
        optimizer: RowOptimizerConfig | Mapping[str, Chosen],
        seed: int = 0,
        shard: int = 0,
        shards: int = 1,
        lifecycles: Mapping[str, Lifecycle] | None = None,
    ):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"Two tables share a name: {names}.")
        lifecycles = lifecycles or {}
        unknown = sorted(set(lifecycles) - set(names))
        if unknown:
            raise ConfigError(
                f"A lifecycle is set for {', '.join(map(repr, unknown))}, which the model does "
                f"not hold as a sparse table (tables: {', '.join(names) or 'none'})."
            )
        chosen = (
            {name: (optimizer, True) for name in names}
            if isinstance(optimizer, RowOptimizerConfig)
            else optimizer
        )
        self.tables = {
            s.name: ShardTable(
                s, chosen[s.name][0], seed, shard, shards, lifecycle=lifecycles.get(s.name)
            )
            for s in specs
        }
        self.recent = Recent()  # a row pull's initial values, for the push that follows
        for table in self.tables.values():
            table.recent = self.recent
        self.scheduled = {name: chosen[name][1] for name in names}
        self.rows_pulled = 0
        self.rows_pushed = 0

    def start_from(self, rows: Mapping[str, torch.Tensor], chunk: int = 1 << 16) -> None:
        """Each named table's rows that this shard holds set to the module's own
        (``rows[name]``, the whole table by id: ``sparse.embedding.own_rows``), their
        optimizer state fresh, ``chunk`` ids at a time. Tables not named keep their seeded
        initial values."""
        for name, weight in rows.items():
            table = self.table(name)
            if tuple(weight.shape) != (table.spec.rows, table.spec.dim):
                raise ValueError(
                    f"Table {name!r}: rows of shape {tuple(weight.shape)} for a table of "
                    f"({table.spec.rows}, {table.spec.dim})."
                )
            if not bool(torch.isfinite(weight).all()):
                raise ConfigError(
                    f"Table {name!r}: the module's weight, which the table starts from, "
                    "holds NaN or Inf (a weight left as torch.empty made it?); initialise it."
                )
            for lo in range(0, table.spec.rows, chunk):
                ids = np.arange(lo, min(lo + chunk, table.spec.rows), dtype=np.int64)
                if table.shards > 1:
                    ids = ids[shard_of(ids, table.shards) == table.shard]
                table.load_rows(ids, weight[torch.from_numpy(ids)])

    @property
    def specs(self) -> list[TableSpec]:
        return [t.spec for t in self.tables.values()]

    @property
    def held(self) -> int:
        """Rows created so far, over every table."""
        return sum(t.held for t in self.tables.values())

    def table(self, name: str) -> ShardTable:
        table = self.tables.get(name)
        if table is None:
            known = ", ".join(sorted(self.tables)) or "none"
            raise InvalidRequest(f"No table {name!r} is held here (tables: {known}).")
        return table

    def pull(self, name: str, ids: Any) -> torch.Tensor:
        return self.pull_many([(name, ids)])[0]

    def pull_many(self, wanted: Iterable[tuple[str, Any]]) -> list[torch.Tensor]:
        """The rows of each ``(table, ids)``, or InvalidRequest; creates no row."""
        return complete_all(self.lookup_many(wanted))

    def lookup_many(self, wanted: Iterable[tuple[str, Any]], counted: bool = True) -> list[Lookup]:
        """The rows held of each ``(table, ids)`` (every table's ids checked first, or
        InvalidRequest); ``Lookup.complete`` adds the initial values of the rest, which
        the caller may do outside its lock. ``counted``: in ``rows_pulled``."""
        tables = [(self.table(name), ids) for name, ids in wanted]
        checked = [(t, t.check_ids(ids, "A pull")) for t, ids in tables]
        found = [t.lookup(ids) for t, ids in checked]
        if counted:
            self.rows_pulled += sum(len(f.ids) for f in found)
        return found

    def reply_bytes(self, wanted: Iterable[tuple[str, Any]]) -> int:
        """The bytes of the rows a pull of each ``(table, ids)`` would answer (tables not
        held count nothing: the pull refuses them)."""
        total = 0
        for name, ids in wanted:
            table = self.tables.get(name)
            if table is not None:
                spec = table.spec
                total += len(ids) * spec.dim * np.dtype(spec.dtype).itemsize
        return total

    def check(self, pushes: Iterable[RowGradients], nonfinite: bool = False) -> list[RowGradients]:
        """The pushes as ``apply`` takes them (``Checked``: with the initial values of rows
        not held yet), or InvalidRequest; changes nothing. ``nonfinite``: rows with NaN or
        Inf pass (see ``finite``), for ``--skip-nonfinite``."""
        valid: list[tuple[str, ShardTable, np.ndarray, torch.Tensor]] = []
        seen: set[str] = set()
        for push in pushes:
            if push.table in seen:
                raise InvalidRequest(
                    f"A push names table {push.table!r} twice; send its rows once, coalesced."
                )
            seen.add(push.table)
            table = self.table(push.table)
            valid.append((push.table, table, *table.check_push(push.ids, push.grads, nonfinite)))
        prepared = prepare_all([(table, ids) for _, table, ids, _ in valid])
        return [
            Checked(name, ids, grads, ready)
            for (name, _, ids, grads), ready in zip(valid, prepared, strict=True)
        ]

    def apply(
        self, checked: Iterable[RowGradients], lr: float | None = None, step: int | None = None
    ) -> None:
        """One optimizer step on each checked push's rows, at ``lr`` (the server's schedule;
        None: the row optimizer's own), as the server's ``step`` (the version it makes:
        the rows' last step pushed, and their TTL, count these)."""
        named = set()
        for push in checked:
            scheduled = self.scheduled[push.table]
            prepared = push.prepared if isinstance(push, Checked) else None
            rate = lr if scheduled else None
            self.tables[push.table].apply(push.ids, push.grads, rate, step, prepared)
            self.rows_pushed += len(push.ids)
            named.add(push.table)
        if step is not None:  # the TTL of the tables this push did not name
            for name, table in self.tables.items():
                if name not in named:
                    table.tick(step)

    def tallies(self) -> dict[str, dict[str, int]]:
        """Each table's rows held and lifecycle counters (admitted, evicted, dropped,
        reborn)."""
        return {name: {"rows": t.held, **t.tally.state()} for name, t in self.tables.items()}

    def state_dict(self) -> dict[str, Any]:
        """Every table whole, copied (``model_state_dict``; checkpoints take changes)."""
        return {name: tablestate.state_dict(t) for name, t in self.tables.items()}

    def take_changes(self) -> dict[str, TableChanges]:
        """Each table's rows changed since the last take (``tablestate.take_changes``)."""
        return {name: tablestate.take_changes(t) for name, t in self.tables.items()}

    def layouts(self) -> dict[str, dict[str, Any]]:
        """What ``whole_tables`` needs besides the rows: each table's size, dtype and key,
        and the shard count (plain values, for a checkpoint)."""
        return {
            name: {
                "rows": t.spec.rows,
                "dim": t.spec.dim,
                "dtype": t.spec.dtype,
                "key": int(t.key),
                "shards": t.shards,
                "init": t.spec.init,
            }
            for name, t in self.tables.items()
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if set(saved) != set(self.tables):
            raise ValueError(
                f"The saved tables {sorted(saved)} are not this run's {sorted(self.tables)}."
            )
        for name, table in self.tables.items():
            tablestate.load_state_dict(table, saved[name])


def finite(checked: Iterable[RowGradients]) -> bool:
    """Whether every row gradient of a push is finite."""
    return all(bool(torch.isfinite(p.grads).all()) for p in checked)


WHOLE_TABLE_BYTES = 1 << 30  # larger tables are not written whole into a model_state_dict


def too_large_for_whole(rows: int, dim: int, dtype: str, limit: int | None) -> str | None:
    """Why a table of ``rows`` x ``dim`` is not written whole (into a ``model_state_dict``,
    launch's checkpoint.pt), or None: unbounded, or over ``limit`` bytes."""
    if not rows:
        return "it is unbounded"
    size = rows * dim * np.dtype(dtype).itemsize
    if limit is not None and size > limit:
        return f"it is {size / 2**30:.1f} GiB, over the {limit / 2**30:.0f} GiB written whole"
    return None


KEPT_ON_SERVERS = "they stay on the servers, and in their checkpoints where --checkpoint-dir is set"


def say_left_out(name: str, where: str, why: str, kept: str) -> None:
    """Log that table ``name`` is left out of ``where`` (``why``), and where its rows are."""
    log.warning(
        "table %r is not written whole into %s (%s); its rows: %s (paramserver export "
        "--snapshot serves them from checkpoints)",
        name,
        where,
        why,
        kept,
    )


def whole_tables(
    layouts: dict[str, dict[str, Any]],
    saved: Sequence[Any],
    limit: int | None = WHOLE_TABLE_BYTES,
    where: str = "",
) -> dict[str, torch.Tensor]:
    """``{"NAME.weight": the whole table}`` from every shard's rows (``saved``, one a shard:
    a ``state_dict``, or row files read a chunk at a time, ``row_reader.RowChain``): their
    rows where touched, the seeded initial values elsewhere. Empty
    when ``saved`` lacks a shard (a shard of several holds a part of each table), and for
    tables over ``limit`` bytes (None: no limit), and unbounded tables (rows 0); with
    ``where`` (what they are left out of), each table left out is logged."""
    out = {}
    for name, lay in layouts.items():
        rows, dim = lay["rows"], lay["dim"]
        if lay["shards"] != len(saved):
            continue
        why = too_large_for_whole(rows, dim, lay["dtype"], limit)
        if why:
            if where:
                say_left_out(name, where, why, KEPT_ON_SERVERS)
            continue
        init = Init.parse(lay.get("init", "normal"))
        table = torch.empty((rows, dim), dtype=getattr(torch, lay["dtype"]))
        step = max(1, (1 << 20) // dim)  # initial values a chunk at a time: bounded temporaries
        for lo in range(0, rows, step):
            ids = np.arange(lo, min(lo + step, rows))
            table[lo : lo + len(ids)] = torch.from_numpy(
                initial_rows(np.uint64(lay["key"]), ids, dim, lay["dtype"], init)
            )
        for shard in saved:
            if hasattr(shard, "merged"):  # row files, read a chunk at a time
                for block in shard.merged(name):
                    table[torch.from_numpy(block.ids)] = block.values.to(table.dtype)
            else:
                held = shard[name]
                table[held["ids"]] = held["values"].to(table.dtype)
        out[f"{name}.weight"] = table
    return out
