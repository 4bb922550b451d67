"""Atomic checkpoints that load with plain ``torch.load``.

Keys of every checkpoint file (``launch``'s run folder and a server's ``--checkpoint-dir``):
    format            "paramserver-checkpoint-v1"
    model_state_dict  {name: tensor}, parameters and buffers:
                      ``model.load_state_dict(ckpt["model_state_dict"])``
    version           optimizer steps applied
    policy            the run's staleness policy

A server's checkpoint (``SERVER_FILE`` in ``--checkpoint-dir``) also holds what a resumed
server needs to go on exactly where it stopped:
    optimizer_state   the server optimizer's ``state_dict()`` (flat parameter 0) and its
                      ``settings`` ({name, lr, momentum, ...}: the OptimizerConfig that wrote
                      it; absent from older checkpoints): a resumed server refuses another
                      optimizer's state (``server/optim/optimizer_resume.py``)
    rounds            sync rounds completed
    incarnation       the server process that wrote it
    members           [{worker_id, name, rank, clock, samples}]: the clocks say which pushes
                      the weights hold, so a worker that rejoins redoes exactly the rest
    membership        {floor, joined_total, expired_total}
    queue             the batch queue (``paramserver.server.bookkeeping.batch_queue``), or None; its
                      ``groups`` are the batches to hand out again, one push's a group
    sync_round        {sum, from, n}: the gradients of a sync round in progress
    buffers           {worker_id: tensor}: each worker's latest buffer values, whose mean
                      the model's buffers hold (``server/bookkeeping/buffers.py``)
    frozen            the names of the frozen parameters in ``model_state_dict`` (constants,
                      so that it loads with ``load_state_dict(strict=True)``)
    counters          pushes_applied, duplicates, skipped, samples, bytes_in, bytes_out, ...
    tables            None (older checkpoints: {name: {ids, values, state, steps}}, every
                      row held)
    row_chain         the sparse tables' rows: the row folders beside the file, base first,
                      then the deltas (``server/disk/row_format.py``); None without tables
    row_sums          {folder: SHA-256 of its manifest.json}
    norm_last         (round, total): the last sync round applied with its norm over shards
    table_layouts     {name: {rows, dim, dtype, key, shards}}; the tables are not in
                      ``model_state_dict`` (``paramserver export`` writes them whole)
    row_round         sync: the row gradients of the round in progress
    ledger            {below, above, applied, repeated}: the server-handed batches this
                      server applied a gradient of (``server/bookkeeping/ledger.py``)
    saved_at          wall-clock time of writing (seconds since the epoch)
    model             the --model of the server that wrote it ("" for a model given in
                      Python; absent from older checkpoints), named when it does not match

A sharded run also keeps consistent cuts (``cut_file``, ``server/bookkeeping/cuts.py``): every shard
writes its state at the same points, so that when one shard restarts from its newest cut,
the others rewind to the same cut and the run resumes as one model.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paramserver.codec import layout
from paramserver.errors import ConfigError

log = logging.getLogger(__name__)

FORMAT = "paramserver-checkpoint-v1"
SERVER_FILE = "server-checkpoint.pt"


def save(path: str | Path, model_state_dict: dict[str, torch.Tensor], **meta: Any) -> Path:
    """Write a checkpoint atomically: temporary file, fsync, rename, fsync of the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "model_state_dict": model_state_dict,
        "saved_at": time.time(),
        **meta,
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint (tensors and plain values only: no code is unpickled)."""
    return torch.load(path, weights_only=True)


def read(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """``load``, its tensors mapped with ``mmap``; whatever fails is a ConfigError naming
    the file, its size and the likely cause (a torn file gave "[Errno 22] Invalid
    argument", no more)."""
    try:
        if mmap:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return load(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same sentence
        raise unreadable(Path(path), exc) from None


def unreadable(path: Path, exc: BaseException) -> ConfigError:
    """The refusal of a checkpoint file that cannot be read."""
    try:
        size = f"{path.stat().st_size} bytes"
    except OSError as err:
        return ConfigError(f"Cannot read the checkpoint {path}: {err.strerror or err}.")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError(
        f"Cannot read the checkpoint {path} ({size}): it is cut short or corrupt, or not a "
        "checkpoint (servers write theirs whole, by rename: was it copied, or its disk "
        f"full?): {type(exc).__name__}: {first}"
    )


def server_file(shard: int = 0, shards: int = 1) -> str:
    """The checkpoint's name in ``--checkpoint-dir``: ``SERVER_FILE``, or for shard I of S
    ``server-checkpoint-shardIofS.pt`` (its weights: one tensor, ``flat``)."""
    return SERVER_FILE if shards == 1 else f"server-checkpoint-shard{shard}of{shards}.pt"


def cut_file(shard: int, shards: int, round_: int) -> str:
    """The name of shard I of S's consistent cut at ``round_`` (the sync round, or every
    worker's clock): every shard writes one at the same points (``--checkpoint-every N``)."""
    return f"server-cut-shard{shard}of{shards}-round{round_:09d}.pt"


def list_cuts(directory: str | Path, shard: int, shards: int) -> dict[int, Path]:
    """The cuts of shard I of S in ``directory``, by round."""
    prefix = f"server-cut-shard{shard}of{shards}-round"
    found = {}
    for path in Path(directory).glob(f"{prefix}*.pt"):
        digits = path.name[len(prefix) : -len(".pt")]
        if digits.isdigit():
            found[int(digits)] = path
    return found


def save_server(
    directory: str | Path, manifest: layout.Manifest, state: dict[str, Any], name: str = SERVER_FILE
) -> Path:
    """Write a server state (``CoordinatorSnapshot.as_dict()``, its tables' rows already in
    the row folders its ``row_chain`` names) to ``directory``: its parameters and buffers
    and its frozen parameters as ``model_state_dict``."""
    state = dict(state)
    frozen = state.pop("frozen", {})
    model_state_dict = {**layout.state_dict(manifest, state.pop("weights")), **frozen}
    return save(Path(directory) / name, model_state_dict, frozen=sorted(frozen), **state)


def _named(model: str | None) -> str:
    if model is None:
        return "a model it does not name (an older checkpoint)"
    return f"--model {model}" if model else "a model given in Python"


def mismatch(path: Path, written_by: str | None, loading: str | None) -> str:
    """The sentence that a checkpoint at ``path`` (written by a server of ``written_by``)
    does not match the model of ``loading`` (None: unknown): the file, and both models."""
    against = "the model it is read for" if loading is None else _named(loading)
    return f"{path} was written by a server of {_named(written_by)} and does not match {against}"


def load_server(
    directory: str | Path,
    manifest: layout.Manifest,
    name: str = SERVER_FILE,
    model: str | None = None,
) -> tuple[dict[str, Any], np.ndarray] | None:
    """The server state in ``directory`` and its flat weights; None when there is none.
    ``model``: the --model of the server loading it, for the message of a mismatch.

    Raises:
        ConfigError: the file is not a server checkpoint of this model.
    """
    path = Path(directory) / name
    if not path.exists():
        return None
    state = read(path)
    if state.get("format") != FORMAT or "optimizer_state" not in state:
        raise ConfigError(f"{path} is not a paramserver server checkpoint.")
    tables = set(state.get("tables") or {}) | set(state.get("table_layouts") or {})
    frozen = set(state.get("frozen", ())) | {f"{t}.weight" for t in tables}
    weights = {n: t for n, t in state["model_state_dict"].items() if n not in frozen}
    roles = {s.name: s.role for s in manifest.tensors}
    named = sorted(weights.items(), key=lambda kv: layout.ROLES.index(roles.get(kv[0], "param")))
    try:
        saved = layout.Manifest.from_tensors(named, [roles.get(n, "param") for n, _ in named])
        manifest.check_compatible(saved, "the checkpoint")
    except ConfigError as exc:
        raise ConfigError(f"{mismatch(path, state.get('model'), model)}: {exc}") from None
    flat = torch.empty(manifest.numel, dtype=manifest.torch_dtype)
    layout.flatten_into(manifest, [weights[s.name] for s in manifest.tensors], flat)
    return with_rows(state, path), flat.numpy()


def with_rows(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """A checkpoint's state read from ``path``, its ``tables`` the row folders its
    ``row_chain`` names beside it (``row_reader.RowChain``, read when used)."""
    if state.get("row_chain") is not None:
        from paramserver.server.disk.row_reader import RowChain

        state["tables"] = RowChain(path.parent, state["row_chain"], state.get("row_sums"))
    return state
