"""Re-partitioning a run's state for another shard count, as decisions on states already
read (no I/O): the dense ranges joined and split at the new ranges (weights, the
optimizer's per-element state, each worker's buffer values, a sync round in progress),
a sync round's row gradients re-hashed, the rest as shard 0 held it (members and clocks,
the batch plan, the ledger, counters agree at a consistent point). ``reshard.py`` reads
and writes the files.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paramserver.codec import idle, layout
from paramserver.codec.layout import Manifest
from paramserver.errors import ConfigError
from paramserver.server.optim.user_optimizer import PIECES
from paramserver.sparse.rows import shard_of


@dataclass
class Source:
    """The S shards' states of one consistent point, read and checked: each shard's state
    (its ``tables`` a ``RowChain``) and flat range, and which files they are, in words."""

    states: list[dict[str, Any]]
    flats: list[np.ndarray]
    which: str
    paths: list[Path]

    @property
    def shards(self) -> int:
        return len(self.states)


def shard_range(whole: Manifest, shard: int, shards: int) -> tuple[int, int]:
    return (0, whole.numel) if shards == 1 else layout.shard_range(whole.numel, shard, shards)


def shard_manifest(whole: Manifest, shard: int, shards: int) -> Manifest:
    return (
        whole if shards == 1 else layout.shard_manifest(whole, *shard_range(whole, shard, shards))
    )


def _per_element(
    parts: list[torch.Tensor | None], sizes: list[int], lo: int, hi: int
) -> torch.Tensor:
    """The per-element tensors of each old shard (None: none, for a shard without elements
    of this section) joined in order and cut at the new shard's [lo, hi)."""
    kind = next((p.dtype for p in parts if p is not None), torch.float32)
    joined = torch.cat(
        [
            p.reshape(-1) if p is not None else torch.zeros(n, dtype=kind)
            for p, n in zip(parts, sizes, strict=True)
        ]
    )
    return joined[lo:hi].clone()


def _optimizer(states: list[dict[str, Any]], sizes: list[int], lo: int, hi: int) -> dict[str, Any]:
    """The server optimizer's state for the new shard's parameters [lo, hi) (of the
    parameters' section): per-element state joined and cut, ``step`` as shard 0 had it, and
    a user's optimizer's pieces (each with its own step) moved to the new shard."""
    first = copy.deepcopy(states[0]["optimizer_state"])
    if any(PIECES in s["optimizer_state"] for s in states):
        first[PIECES] = _pieces(
            [s["optimizer_state"].get(PIECES) or [] for s in states], sizes, lo, hi
        )
    held = [s["optimizer_state"].get("state", {}).get(0) for s in states]
    base = next((h for h in held if h), None)
    if base is None:
        return first
    out = {}
    for key, value in base.items():
        if key == "step" or not isinstance(value, torch.Tensor):
            out[key] = copy.deepcopy(value)
        else:
            out[key] = _per_element([h.get(key) if h else None for h in held], sizes, lo, hi)
    first["state"] = {0: out}
    return first


def _pieces(layouts: list[list[Any]], sizes: list[int], lo: int, hi: int) -> list[list[Any]]:
    """The old shards' pieces (name, lo, hi, step: from each one's start) as the new shard
    [lo, hi) holds them: cut at its bounds, from its start, a tensor's consecutive pieces
    joined (one piece a tensor a shard, as ``user_optimizer.pieces`` makes them)."""
    out: list[list[Any]] = []
    start = 0
    for rows, size in zip(layouts, sizes, strict=True):
        for name, a, b, step in rows:
            a, b = max(start + int(a), lo), min(start + int(b), hi)
            if a >= b:
                continue
            if out and out[-1][0] == name and out[-1][2] == a - lo:
                out[-1][2] = b - lo
                out[-1][3] = max(out[-1][3], float(step))  # the same on every shard
            else:
                out.append([name, a - lo, b - lo, float(step)])
        start += size
    return out


def whole_optimizer(states: list[dict[str, Any]], whole: Manifest) -> dict[str, Any]:
    """The server optimizer's state over every parameter of the model, from its shards'
    states (shard 0 first): what one server holding the whole model resumes with (under
    local steps, the outer optimizer's momentum; ``paramserver export`` writes it)."""
    sec = _sections(whole, len(states), 1, 0)
    return _optimizer(states, sec["params"], *sec["param_range"])


def _sections(whole: Manifest, source_shards: int, shards: int, shard: int) -> dict[str, Any]:
    """Per old shard, how many of its elements are parameters and how many buffers; and the
    new shard's [lo, hi) within the parameters' and the buffers' sections."""
    p_end = whole.section("param")[1]
    old = [shard_range(whole, i, source_shards) for i in range(source_shards)]
    lo, hi = shard_range(whole, shard, shards)
    return {
        "params": [max(0, min(b, p_end) - a) for a, b in old],
        "buffers": [b - a - max(0, min(b, p_end) - a) for a, b in old],
        "param_range": (min(lo, p_end), min(hi, p_end)),
        "buffer_range": (max(lo, p_end) - p_end, max(hi, p_end) - p_end),
        "range": (lo, hi),
    }


def _idle(states: list[dict[str, Any]], sizes: list[int], lo: int, hi: int) -> Any:
    """The round's parameters no push had a gradient of (``codec/idle.py``), each old
    shard's ranges (from its own start) moved to the whole model's and cut to the new
    shard's parameters [lo, hi) (an old shard whose round had no push yet: all of its
    parameters); None where no shard's round had one. A round of an older checkpoint
    (no ranges): none left alone."""
    rounds = [s["sync_round"] for s in states]
    if all(not r.get("n") for r in rounds):
        return None
    spans, start = [], 0
    for r, size in zip(rounds, sizes, strict=True):
        if not r.get("n"):  # no push reached this shard's parameters yet
            spans.append((start, start + size))
        else:
            spans += [(start + int(a), start + int(b)) for a, b in r.get("idle") or ()]
        start += size
    return [list(x) for x in idle.ranges(sorted(x for x in spans if x[0] < x[1]), lo, hi)]


def dense_state(source: Source, whole: Manifest, shard: int, shards: int) -> dict[str, Any]:
    """New shard ``shard`` of ``shards``'s state, its tables aside (``tables`` None,
    ``table_layouts`` for the new shard count, ``row_round`` re-hashed): a decision on the
    read states, no I/O."""
    sec = _sections(whole, source.shards, shards, shard)
    first = source.states[0]
    state = {
        k: copy.deepcopy(v) for k, v in first.items() if k not in ("tables", "model_state_dict")
    }
    lo, hi = sec["range"]
    state["weights"] = np.concatenate(source.flats)[lo:hi].copy()
    state["optimizer_state"] = _optimizer(source.states, sec["params"], *sec["param_range"])
    workers = sorted({w for s in source.states for w in (s.get("buffers") or {})})
    state["buffers"] = {
        w: _per_element(
            [(s.get("buffers") or {}).get(w) for s in source.states],
            sec["buffers"],
            *sec["buffer_range"],
        )
        for w in workers
    }
    sums = [s["sync_round"].get("sum") for s in source.states]
    if any(x is not None for x in sums):
        state["sync_round"]["sum"] = _per_element(sums, sec["params"], *sec["param_range"])
    state["sync_round"]["idle"] = _idle(source.states, sec["params"], *sec["param_range"])
    layouts = first.get("table_layouts")
    if layouts:
        state["table_layouts"] = {n: {**lay, "shards": shards} for n, lay in layouts.items()}
    state["row_round"] = _row_round(
        [s.get("row_round") or {} for s in source.states], shard, shards
    )
    state["incarnation"] = uuid.uuid4().hex[:12]
    state["cut"] = _cut(first)
    state["tables"] = None
    return state


def _cut(state: dict[str, Any]) -> int:
    """The clock the re-partitioned state stands at, as a cut of the new shards: the sync
    round, or the slowest member's clock (the last cut where none is a member)."""
    if str(state["policy"]) == "sync":
        return int(state["rounds"])
    clocks = [int(m["clock"]) for m in state.get("members", [])]
    return max(int(state.get("cut", 0)), min(clocks, default=0))


def _row_round(rounds: list[dict[str, Any]], shard: int, shards: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in rounds:
        for table, pushes in r.items():
            for ids, grads in pushes:
                mine = (
                    shard_of(ids.numpy(), shards) == shard
                    if shards > 1
                    else np.ones(len(ids), bool)
                )
                if mine.any():
                    at = torch.from_numpy(np.flatnonzero(mine))
                    out.setdefault(table, []).append((ids[at].clone(), grads[at].clone()))
    return out


def check_agree(states: list[dict[str, Any]], paths: list[Path]) -> None:
    for key in ("version", "rounds", "policy"):
        values = [s[key] for s in states]
        if len(set(map(str, values))) > 1:
            raise ConfigError(
                f"The checkpoints {', '.join(map(str, paths))} do not hold one point of the "
                f"run ({key} {values}): they cannot be re-partitioned together."
            )
