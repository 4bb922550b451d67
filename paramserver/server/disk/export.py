"""The whole model from a run's server checkpoints, without the servers (``paramserver
export``): the dense part from every shard's range, every sparse table whole (each shard's
rows, the seeded initial values where untouched), the frozen parameters from the model
built with the run's seed.

Which files: ``--round R``, the cuts of round R (``server-cut-shardIofS-roundR.pt``);
otherwise every shard's last checkpoint (``server-checkpoint-shardIofS.pt``, or the single
server's ``server-checkpoint.pt``) when they hold the same pushes (the same version, and
every member at the same clock), as at the end of a run; otherwise the newest round that
every shard cut, which is consistent across the shards. It says which it read.
Decisions (``choose``) are apart from the reading and the assembling.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paramserver import models
from paramserver.codec import layout
from paramserver.errors import ConfigError
from paramserver.server.disk import checkpoint
from paramserver.server.disk.reshard_plan import whole_optimizer
from paramserver.sparse.embedding import make_tables
from paramserver.sparse.tableset import whole_tables

_SHARDED = re.compile(r"server-(?:checkpoint|cut)-shard\d+of(\d+)[.-]")


def shard_counts(directory: Path) -> dict[int, float]:
    """The shard counts whose server files are in ``directory`` (1: a single server's), each
    with the time its newest file was written."""
    counts: dict[int, float] = {}
    for path in directory.glob("server-*.pt"):
        m = _SHARDED.match(path.name)
        n = int(m[1]) if m else 1 if path.name == checkpoint.SERVER_FILE else None
        if n is not None:
            counts[n] = max(counts.get(n, 0.0), path.stat().st_mtime)
    return counts


def shard_count(directory: Path, exclude: int | None = None) -> int:
    """S, from the shards' files in ``directory`` (1: a single server's); where a run was
    re-partitioned (``reshard``) and files of several counts are there, the count whose
    files were written last. ``exclude``: a count not to choose.

    Raises:
        ConfigError: no server files (of another count than ``exclude``).
    """
    counts = {n: t for n, t in shard_counts(directory).items() if n != exclude}
    if not counts:
        raise ConfigError(
            f"{directory} holds no server checkpoints: give the --checkpoint-dir of a run's "
            "servers."
        )
    return max(counts, key=lambda n: counts[n])


@dataclass(frozen=True)
class Final:
    """A shard's last checkpoint as ``choose`` sees it: its version and every member's clock
    (the pushes it holds)."""

    version: int
    clocks: dict[str, int]


def choose(
    finals: list[Final | None], cuts: list[set[int]], round_: int | None
) -> tuple[int | None, str]:
    """The cut round to read (None: the last checkpoints), from each shard's last checkpoint
    (None: no file) and its cuts' rounds; and why, in words. The last checkpoints are taken
    only when they hold the same pushes: equal versions and every member at the same clock
    on every shard (equal versions alone can hold different workers' pushes: async, a step
    that reached shard 0 only and another that reached shard 1 only).

    Raises:
        ConfigError: no consistent set of files.
    """
    common = set.intersection(*cuts) if cuts else set()
    if round_ is not None:
        if round_ not in common:
            raise ConfigError(
                f"Not every shard has a cut at round {round_}; the rounds all "
                f"have: {sorted(common) or 'none'}."
            )
        return round_, f"the cuts of round {round_}, as asked"
    present = [f for f in finals if f is not None]
    if len(present) == len(finals) and len({(f.version, _key(f.clocks)) for f in present}) == 1:
        return None, "the shards' last checkpoints, which hold the same pushes"
    why = _disagree(finals)
    if common:
        return max(common), f"the cuts of round {max(common)}, the newest on every shard ({why})"
    raise ConfigError(
        f"The shards' last checkpoints do not hold the same pushes ({why}) and no round has "
        "a cut on every shard: no consistent model to export."
    )


def _key(clocks: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(clocks.items()))


def _disagree(finals: list[Final | None]) -> str:
    """How the shards' last checkpoints differ, in words."""
    if any(f is None for f in finals):
        missing = [i for i, f in enumerate(finals) if f is None]
        return f"shard {missing[0]} has none"
    present = [f for f in finals if f is not None]
    if len({f.version for f in present}) > 1:
        return f"versions {[f.version for f in present]}"
    return "clocks " + ", ".join(
        f"shard {i} {dict(sorted(f.clocks.items()))}" for i, f in enumerate(present)
    )


def files(
    directory: str | Path, round_: int | None = None, shards: int | None = None
) -> tuple[list[Path], str]:
    """Each shard's file to read, shard 0 first, and which they are, in words (``shards``:
    of that shard count; by default ``shard_count``'s)."""
    directory = Path(directory)
    shards = shard_count(directory) if shards is None else shards
    names = [checkpoint.server_file(i, shards) for i in range(shards)]
    finals = [_final(directory / n) for n in names]
    cuts = [set(checkpoint.list_cuts(directory, i, shards)) for i in range(shards)]
    chosen, which = choose(finals, cuts, round_)
    if chosen is None:
        return [directory / n for n in names], which
    return [directory / checkpoint.cut_file(i, shards, chosen) for i in range(shards)], which


def _read(path: Path) -> dict[str, Any]:
    state = checkpoint.read(path)
    try:
        return checkpoint.with_rows(state, path)
    except Exception as exc:  # noqa: BLE001 - its row files: the same sentence
        raise checkpoint.unreadable(path, exc) from None


def _final(path: Path) -> Final | None:
    if not path.exists():
        return None
    saved = checkpoint.read(path, mmap=True)  # mapped, not read
    clocks = {str(m["worker_id"]): int(m["clock"]) for m in saved.get("members", [])}
    return Final(int(saved["version"]), clocks)


def assemble(
    model: torch.nn.Module, states: list[dict[str, Any]], tables: bool = True
) -> dict[str, torch.Tensor]:
    """``model``'s whole state dict from its shards' checkpoint states (shard 0 first):
    what ``model.load_state_dict(..., strict=True)`` takes; ``tables`` False: without its
    sparse tables (a serving snapshot writes them row by row)."""
    layouts = states[0].get("table_layouts") or {}
    make_tables(model, names=layouts)  # the run's tables (--table-rows made dense ones too)
    manifest, _ = models.state(model)  # parameters and buffers, as the servers lay them out
    if len(states) == 1:
        held = states[0]["model_state_dict"]
        missing = [t.name for t in manifest.tensors if t.name not in held]
        if missing:
            raise ConfigError(
                f"The checkpoint holds no {missing[0]!r} ({len(missing)} of the model's "
                f"{len(manifest.tensors)} tensors are missing): is --model the run's?"
            )
    sections = []
    for role in layout.ROLES:
        if len(states) == 1:  # a single server's checkpoint holds the tensors by name
            named = states[0]["model_state_dict"]
            parts = [named[t.name] for t in manifest.tensors if t.role == role]
        else:  # a shard's holds its part of each section as one tensor (SHARD_TENSORS)
            name, _ = layout.SHARD_TENSORS[role]
            parts = [s["model_state_dict"][name] for s in states if name in s["model_state_dict"]]
        sections += [p.reshape(-1).to(manifest.torch_dtype) for p in parts]
    flat = torch.cat(sections) if sections else torch.empty(0, dtype=manifest.torch_dtype)
    if flat.numel() != manifest.numel:
        raise ConfigError(
            f"The checkpoints hold {flat.numel()} values; the model has "
            f"{manifest.numel}: is it the run's --model?"
        )
    out = dict(model.state_dict())  # frozen parameters: as the model built with the seed
    out.update(layout.state_dict(manifest, flat.numpy()))
    if tables:
        _fits_in_memory(layouts)
        out.update(whole_tables(layouts, [s.get("tables") or {} for s in states], limit=None))
    # a tied head: under its second name too, with the trained values (not the initial)
    return models.with_aliases(out, models.aliases(model))


def _fits_in_memory(layouts: dict[str, dict[str, Any]]) -> None:
    """Refuse, before allocating, a table that cannot be held whole here (a declared
    10^12-row table would try 64 TB): half of this machine's memory at most. Unbounded
    tables are not written whole (they have no whole)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    for name, lay in layouts.items():
        size = lay["rows"] * lay["dim"] * np.dtype(lay["dtype"]).itemsize
        if size > memory // 2:
            raise ConfigError(
                f"Table {name!r} is {size / 2**30:.1f} GiB whole, over half of this machine's "
                f"{memory / 2**30:.0f} GiB: paramserver export --snapshot writes its rows "
                "without holding it whole."
            )


def export(
    directory: str | Path, model: str, seed: int, out: str | Path, round_: int | None = None
) -> tuple[Path, int, str]:
    """Write the whole model of the run whose server checkpoints are in ``directory`` to
    ``out`` (a checkpoint that ``torch.load(weights_only=True)`` reads); returns the path,
    the version and which files it read, in words.

    Raises:
        ConfigError: no consistent set of checkpoints, or another model's.
    """
    paths, which = files(directory, round_)
    states = [_read(p) for p in paths]
    versions = {int(s["version"]) for s in states}
    built = models.build(model, seed=seed)
    state = assemble(built, states)
    differs = models.state_difference(built, state)  # it loads, or the model is not the run's
    if differs:
        raise ConfigError(
            f"The checkpoints in {directory} do not load into --model {model}: {differs}."
        )
    version = max(versions)
    manifest, _ = models.state(built)
    meta = {
        "version": version,
        "policy": states[0].get("policy", ""),
        "exported_from": [str(p) for p in paths],
        # the server optimizer's (an outer optimizer's) state, whole: a run goes on from it
        "optimizer_state": whole_optimizer(states, manifest),
    }
    return checkpoint.save(out, state, model=model, **meta), version, which
