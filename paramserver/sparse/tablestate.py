"""A shard's table as checkpoints see it: what changed since the last checkpoint took it
(``take_changes``), rows put back one block at a time (``put_rows``, ``drop_rows``,
``set_meta``), and the whole table as one state dict (``state_dict``, the older
checkpoints' form, still read). No I/O: ``server/disk/row_format.py`` writes and reads the files.

Changes: every row a push, a creation or a load wrote is marked in ``ShardTable.changed``
(by slot); an evicted row is unmarked and its id kept in ``ShardTable.removed``.
``take_changes`` copies the marked rows (ids sorted) with their optimizer state and
counters, the ids evicted and not held again, and the table's counters, then clears the
marks: what it copies is what changed since the previous take, never the whole table
(unless all of it changed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from paramserver.sparse.index import RowIndex

if TYPE_CHECKING:
    from paramserver.sparse.table import ShardTable


@dataclass(frozen=True)
class RowBlock:
    """Rows of one table with all a checkpoint keeps of them: ids (distinct; sorted where
    a file holds them), values, optimizer state, pushes applied and the step of the last."""

    ids: np.ndarray  # int64
    values: torch.Tensor  # (n, dim)
    state: list[torch.Tensor]  # (n, width) each
    hits: np.ndarray  # int32
    last: np.ndarray  # int32

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, at: np.ndarray) -> RowBlock:
        """The rows at positions ``at`` (indices or a mask)."""
        pick = torch.from_numpy(np.flatnonzero(at) if at.dtype == bool else at)
        return RowBlock(
            self.ids[at],
            self.values[pick],
            [s[pick] for s in self.state],
            self.hits[at],
            self.last[at],
        )

    @staticmethod
    def cat(blocks: list[RowBlock]) -> RowBlock:
        return RowBlock(
            np.concatenate([b.ids for b in blocks]),
            torch.cat([b.values for b in blocks]),
            [torch.cat(parts) for parts in zip(*(b.state for b in blocks), strict=True)],
            np.concatenate([b.hits for b in blocks]),
            np.concatenate([b.last for b in blocks]),
        )


@dataclass(frozen=True)
class TableChanges:
    """What one table changed since the last take: the rows written (ids sorted), the ids
    evicted and not held now (sorted), and the table's counters and admission sketch as
    they are now (``meta``: steps, tally, swept; plain values and tensors)."""

    rows: RowBlock
    removed: np.ndarray
    meta: dict[str, Any]
    sketch: np.ndarray | None


def meta(table: ShardTable) -> dict[str, Any]:
    return {"steps": table.optimizer.steps, "tally": table.tally.saved(), "swept": table._swept}


def take_changes(table: ShardTable) -> TableChanges:
    """The rows changed since the last take (copied), the ids evicted since and not held
    now, and the counters; the marks are cleared. The caller holds the lock the table's
    pushes take."""
    n = table.index.slots_used
    slots = np.flatnonzero(table.changed[:n])
    ids = table.slot_ids[slots]
    order = np.argsort(ids, kind="stable")
    slots, ids = slots[order], ids[order]
    at = torch.from_numpy(slots)
    rows = RowBlock(
        ids,
        table.values[at],
        [s[at] for s in table.state],
        table.hits[slots].copy(),
        table.last[slots].copy(),
    )
    removed = np.unique(np.concatenate(table.removed)) if table.removed else np.empty(0, np.int64)
    removed = removed[table.index.find(removed) < 0]
    table.changed[:n] = False
    table.removed = []
    sketch = None if table.sketch is None else table.sketch.counts.copy()
    return TableChanges(rows, removed, meta(table), sketch)


def clear(table: ShardTable) -> None:
    """Empty the table: no row held, no mark (before rows are put back from files)."""
    table.index = RowIndex(1024)
    table.changed[:] = False
    table.removed = []


def fitted(table: ShardTable, saved: list[torch.Tensor], hits: np.ndarray) -> list[torch.Tensor]:
    """Saved optimizer state as this table's optimizer keeps it. Adam's moments are the
    same in both forms: a run saved under ``adam`` (lazy, each row's steps) resumes under
    ``sparse-adam`` (the table's, the default for ``--optimizer adam`` since issue 44)
    without the steps, and one saved under ``sparse-adam`` resumes under ``adam`` with each
    row's pushes (``hits``) as its steps.

    Raises:
        ValueError: any other optimizer's state.
    """
    name, keeps = table.optimizer.config.name, len(table.state)
    if name == "sparse-adam" and len(saved) == 3 and saved[2].dtype == torch.int64:
        return list(saved[:2])
    if name == "adam" and len(saved) == 2:
        steps = torch.from_numpy(np.asarray(hits, np.int64)).view(-1, 1).clamp(min=1)
        return [*saved, steps]
    if len(saved) != keeps:
        raise ValueError(
            f"Table {table.spec.name!r}: the saved optimizer state has {len(saved)} "
            f"parts; {name} keeps {keeps}."
        )
    return list(saved)


def put_rows(table: ShardTable, block: RowBlock) -> None:
    """Rows ``block`` set as they were saved (created where not held), unmarked: they are
    on disk already."""
    if not len(block):
        return
    ids = table.check_ids(block.ids, "Rows restored")
    slots = table.index.find(ids)
    new = slots < 0
    if new.any():
        slots[new] = table.index.insert(ids[new])
        table._reserve(table.index.slots_used)
        table.slot_ids[slots[new]] = ids[new]
    states = fitted(table, block.state, block.hits)
    at = torch.from_numpy(slots)
    table.values[at] = block.values.to(table.values.dtype)
    for mine, theirs in zip(table.state, states, strict=True):
        mine[at] = theirs.to(mine.dtype)
    table.hits[slots] = block.hits
    table.last[slots] = block.last
    table.changed[slots] = False


def drop_rows(table: ShardTable, ids: np.ndarray) -> None:
    """Rows ``ids`` no longer held (those held among them), as a saved eviction says."""
    if len(ids):
        table.index.remove(np.asarray(ids, np.int64))


def set_meta(table: ShardTable, saved: dict[str, Any], sketch: np.ndarray | None) -> None:
    """The table's counters (and admission sketch) as saved."""
    table.optimizer.steps = int(saved["steps"])
    table.tally.load(saved.get("tally", {}))
    table._swept = int(saved.get("swept", 0))
    if table.sketch is not None and sketch is not None and len(sketch) == len(table.sketch.counts):
        table.sketch.counts[:] = sketch


def state_dict(table: ShardTable) -> dict[str, Any]:
    """Every row held, copied, and the counters: the whole table in memory (the form
    older checkpoints held; ``model_state_dict`` reads the rows so)."""
    ids, slots = table.index.items()
    take = torch.from_numpy(slots)
    return {
        "ids": torch.from_numpy(ids),
        "values": table.values[take].clone(),
        "state": [s[take].clone() for s in table.state],
        "steps": table.optimizer.steps,
        "hits": torch.from_numpy(table.hits[slots].copy()),
        "last": torch.from_numpy(table.last[slots].copy()),
        "tally": table.tally.saved(),
        "swept": table._swept,
        "sketch": None if table.sketch is None else torch.from_numpy(table.sketch.counts.copy()),
    }


def load_state_dict(table: ShardTable, saved: dict[str, Any]) -> None:
    """The table as ``state_dict`` saved it; every row marked changed (the next take
    writes them all: they are in no row file yet)."""
    ids = table.check_ids(saved["ids"].numpy(), "A restored table")
    states = list(saved["state"])
    if table.optimizer.config.name == "adam" and len(states) == 2:
        # a checkpoint from before adam counted each row's steps: the table's, for all
        states.append(torch.full((len(ids), 1), int(saved["steps"]), dtype=torch.int64))
    if len(states) != len(table.state):
        raise ValueError(
            f"Table {table.spec.name!r}: the saved optimizer state does not "
            f"match {table.optimizer.config.name}."
        )
    clear(table)
    n = len(ids)
    # checkpoints from before the lifecycle: one push each, at the table's last step
    hits, last = saved.get("hits"), saved.get("last")
    put_rows(
        table,
        RowBlock(
            ids,
            saved["values"],
            states,
            hits.numpy() if hits is not None else np.ones(n, np.int32),
            last.numpy() if last is not None else np.full(n, int(saved["steps"]), np.int32),
        ),
    )
    table.changed[table.index.find(ids)] = True
    sketch = saved.get("sketch")
    set_meta(
        table,
        {**saved, "tally": saved.get("tally", {"admitted": n})},
        sketch.numpy() if sketch is not None else None,
    )
