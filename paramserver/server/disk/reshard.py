"""A run's checkpoints written by S shards, re-partitioned for S' shards (``paramserver
checkpoint reshard``, and a server started with another ``--shards`` on a checkpoint
folder): ``reshard_plan.py`` decides each new shard's state; this module reads the old
shards' files and writes the new ones, every table's rows re-hashed to the new shards a
chunk at a time with their optimizer state and counters.

The files read are those ``paramserver export`` reads (``export.files``: the shards' last
checkpoints when they hold the same pushes, else the newest common cut, or ``round_``).
Shard J of S' is written on its own (``write_shard``: its rows as a base folder, then its
checkpoint file: a cut for S' > 1, so that the shard resumes from it; the single server's
file for S' = 1), so the servers of a new shard count can each re-partition their own part
of the same folder at start-up, and ``reshard`` writes them all. Every file read is checked
first (torn, foreign, another model, states that do not agree): an error names the file,
and nothing is written.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from paramserver import models
from paramserver.codec.layout import Manifest
from paramserver.errors import ConfigError
from paramserver.server.disk import checkpoint, export, row_format
from paramserver.server.disk.reshard_plan import (
    Source,
    check_agree,
    dense_state,
    shard_manifest,
)
from paramserver.server.disk.row_reader import RowChain
from paramserver.sparse.embedding import make_tables
from paramserver.sparse.rows import shard_of
from paramserver.sparse.tablestate import RowBlock

log = logging.getLogger(__name__)


def read(
    directory: Path,
    whole: Manifest,
    round_: int | None = None,
    shards: int | None = None,
    model: str | None = None,
) -> Source:
    """The consistent set of shard states in ``directory`` for the model of ``whole``, every
    row file verified.

    Raises:
        ConfigError: no consistent set, a file torn, foreign or of another model, or states
            that do not agree (naming the files).
    """
    paths, which = export.files(directory, round_, shards)
    shards = len(paths)
    states, flats = [], []
    for i, path in enumerate(paths):
        manifest = shard_manifest(whole, i, shards)
        loaded = checkpoint.load_server(path.parent, manifest, path.name, model)
        if loaded is None:
            raise ConfigError(f"{path} is missing.")
        state, flat = loaded
        if isinstance(state.get("tables"), RowChain):
            state["tables"].folders()  # every row file checked before anything is written
        elif state.get("table_layouts"):
            raise ConfigError(
                f"{path} holds its tables whole (a checkpoint from before row files): resume "
                "it on its own shard count once, then re-partition the checkpoints it writes."
            )
        states.append(state)
        flats.append(flat)
    check_agree(states, paths)
    return Source(states, flats, which, paths)


def merged_rows(chains: list[RowChain], table: str) -> Iterator[RowBlock]:
    """One table's rows over every old shard (``chains``, each merged on its own), ids
    ascending: a merge of sorted streams, a block of each at a time (ids are disjoint
    across shards)."""
    streams = [chain.merged(table) for chain in chains]
    heads: list[RowBlock | None] = [None] * len(streams)
    while True:
        for i, stream in enumerate(streams):
            while heads[i] is None or not len(heads[i]):  # type: ignore[arg-type]
                heads[i] = next(stream, None)
                if heads[i] is None:
                    break
        live = [h for h in heads if h is not None]
        if not live:
            return
        bound = min(int(h.ids[-1]) for h in live)
        parts = []
        for i, h in enumerate(heads):
            if h is None:
                continue
            cut = int(np.searchsorted(h.ids, bound, "right"))
            parts.append(h.take(np.arange(cut)))
            heads[i] = h.take(np.arange(cut, len(h))) if cut < len(h) else None
            if heads[i] is None:
                heads[i] = next(streams[i], None)
        block = RowBlock.cat(parts)
        yield block.take(np.argsort(block.ids, kind="stable"))


def _write_rows(
    chains: list[RowChain],
    out: Path,
    shard: int,
    shards: int,
    seq: int,
    layouts: dict[str, dict[str, Any]],
) -> tuple[str, str]:
    """New shard ``shard``'s rows of every table as a base folder: the old shards' rows
    merged, those the new shard count hashes to it; counters and lifecycle arrays joined
    (the lifecycle counts, summed, on new shard 0; the evicted ids' bitsets OR-ed and the
    admission sketches summed, saturating, on every new shard: an id is admitted early at
    worst, never late)."""
    tables = {}
    for table, lay in layouts.items():
        entries = [c.folders()[-1].manifest["tables"][table] for c in chains]
        heads = [c.folders()[-1] for c in chains]

        def mine(blocks: Iterator[RowBlock]) -> Iterator[RowBlock]:
            for block in blocks:
                keep = shard_of(block.ids, shards) == shard if shards > 1 else None
                if keep is None:
                    yield block
                elif keep.any():
                    yield block.take(keep)

        arrays = {
            key: [
                np.array(h.array(table, key))
                for h, e in zip(heads, entries, strict=True)
                if key in e["files"]
            ]
            for key in ("evicted", "sketch")
        }
        evicted = np.bitwise_or.reduce(arrays["evicted"]) if arrays["evicted"] else None
        sketch = None
        if arrays["sketch"]:
            total = np.sum([a.astype(np.int64) for a in arrays["sketch"]], axis=0)
            sketch = np.minimum(total, np.iinfo(arrays["sketch"][0].dtype).max).astype(
                arrays["sketch"][0].dtype
            )
        tally = {
            k: sum(int(e["tally"].get(k, 0)) for e in entries) if shard == 0 else 0
            for k in entries[0]["tally"]
        }
        tables[table] = row_format.TableSource(
            lay,
            row_format.widths(entries[0]),
            mine(merged_rows(chains, table)),
            np.empty(0, np.int64),
            max(int(e["steps"]) for e in entries),
            max(int(e["swept"]) for e in entries),
            tally,
            evicted,
            sketch,
        )
    return row_format.write_folder(out, shard, shards, seq, None, tables)


def write_shard(
    source: Source, whole: Manifest, out: Path, shard: int, shards: int, frozen: dict[str, Any]
) -> Path:
    """Write new shard ``shard`` of ``shards`` into ``out``: its rows as a base folder, then
    its checkpoint file (a cut for S' > 1, the single server's file for 1). Returns the
    file."""
    if shards < 1:
        raise ConfigError(f"A checkpoint can be re-partitioned for 1 shard or more, not {shards}.")
    state = dense_state(source, whole, shard, shards)
    chains = [s["tables"] for s in source.states if isinstance(s.get("tables"), RowChain)]
    if chains:
        seq = max(row_format.existing(out, shard, shards), default=0) + 1
        name, sha = _write_rows(chains, out, shard, shards, seq, state["table_layouts"])
        state.update(row_chain=[name], row_sums={name: sha})
    state["frozen"] = frozen if shards == 1 else {}
    file = (
        checkpoint.server_file()
        if shards == 1
        else checkpoint.cut_file(shard, shards, state["cut"])
    )
    path = checkpoint.save_server(out, shard_manifest(whole, shard, shards), state, file)
    log.info(
        "re-partitioned %s for shard %d of %d: %s (version %d)",
        source.which,
        shard,
        shards,
        path,
        int(state["version"]),
    )
    return path


def built(model: str, seed: int, layouts: dict[str, Any]) -> tuple[Manifest, dict[str, Any]]:
    """The whole model's manifest (its sparse tables ``layouts`` names left out, as the
    servers held them) and its frozen parameters, ``model`` built with ``seed``."""
    made = models.build(model, seed=seed)
    make_tables(made, names=layouts)
    manifest, _ = models.state(made)
    frozen = {
        n: p.detach().cpu().clone() for n, p in made.named_parameters() if not p.requires_grad
    }
    return manifest, frozen


def reshard(
    directory: str | Path,
    model: str,
    seed: int,
    shards: int,
    out: str | Path | None = None,
    round_: int | None = None,
) -> tuple[list[Path], str]:
    """Write the checkpoints in ``directory`` (of ``model`` built with ``seed``) for
    ``shards`` shards into ``out`` (default: ``directory`` itself, beside the old files);
    returns the files written and which were read, in words.

    Raises:
        ConfigError: a shard count below 1, ``out`` holding server checkpoints already, no
            consistent set of files, a file torn, foreign or of another model.
    """
    if shards < 1:
        raise ConfigError(f"--shards must be 1 or more; got {shards}.")
    directory = Path(directory)
    target = directory if out is None else Path(out)
    old = export.shard_count(directory, exclude=shards if target == directory else None)
    if target != directory and target.exists() and any(target.glob("server-*.pt")):
        raise ConfigError(f"{target} holds server checkpoints already: give a new folder.")
    if old == shards:
        raise ConfigError(f"The checkpoints in {directory} are of {shards} shards already.")
    paths, _ = export.files(directory, round_, old)
    peek = checkpoint.read(paths[0], mmap=True)
    whole, frozen = built(model, seed, peek.get("table_layouts") or {})
    source = read(directory, whole, round_, old, model)
    target.mkdir(parents=True, exist_ok=True)
    return [write_shard(source, whole, target, j, shards, frozen) for j in range(shards)], (
        source.which
    )


def other_count(directory: Path, shards: int) -> int | None:
    """The shard count of the newest checkpoints in ``directory`` that are not of
    ``shards`` shards; None when there are none."""
    try:
        return export.shard_count(directory, exclude=shards)
    except ConfigError:
        return None


def resume_other(
    directory: Path, whole: Manifest, frozen: dict[str, Any], shard: int, shards: int
) -> bool:
    """A server of shard ``shard`` of ``shards`` that finds no checkpoint of its own in
    ``directory`` but those of another shard count: write its part of them (re-partitioned);
    False when there are none to take."""
    old = other_count(directory, shards)
    if old is None:
        return False
    log.warning(
        "%s holds the checkpoints of %d shard(s), not %d: re-partitioning them for shard %d "
        "(its files are written beside the old ones)",
        directory,
        old,
        shards,
        shard,
    )
    write_shard(read(directory, whole, None, old), whole, directory, shard, shards, frozen)
    return True
