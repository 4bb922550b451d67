"""What a server's coordinator starts from: the model built with the run's seed (or given),
its flat weights, this shard's range of them, its sparse tables and frozen parameters, the
optimizer's store, and the newest state saved in the checkpoint folder (re-partitioned
first where another shard count wrote it: ``reshard.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from paramserver import models
from paramserver.codec.layout import Manifest, flatten_into, shard_manifest, shard_range
from paramserver.config import ServerConfig, parse_table_optimizers
from paramserver.errors import ConfigError
from paramserver.server.bookkeeping.snapshot import CoordinatorSnapshot
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.disk import reshard
from paramserver.server.disk.checkpoint_writer import saved_state
from paramserver.server.engine.coordinator import Coordinator
from paramserver.server.optim import step_rules, user_optimizer
from paramserver.sparse.declared import declared_choices
from paramserver.sparse.embedding import make_tables, own_rows
from paramserver.sparse.memory import SERVER_MMAP_THRESHOLD, fix_mmap_threshold
from paramserver.sparse.tableset import TableSet, table_optimizers
from paramserver.transport import pieces


def initial_weights(model: nn.Module) -> tuple[Manifest, np.ndarray]:
    """The manifest of ``model`` and its parameters and buffers as one flat array."""
    manifest, tensors = models.state(model)
    flat = torch.empty(manifest.numel, dtype=manifest.torch_dtype)
    flatten_into(manifest, tensors, flat)
    return manifest, flat.numpy()


def build_coordinator(
    config: ServerConfig,
    model: nn.Module | None = None,
    now: Callable[[], float] = time.monotonic,
    *,
    resume: bool = False,
    snapshot: CoordinatorSnapshot | None = None,
) -> Coordinator:
    """The server's state for ``config``: ``model``'s weights (default: ``config.model``
    built with ``config.seed``), or this shard's range of them, and the optimizer.

    It goes on from ``snapshot``, or with ``resume`` from the newest state saved in
    ``config.checkpoint_dir`` (``checkpointer.saved_state``) if there is one.

    Raises:
        ConfigError: the model cannot be split into ``config.shards``, or the saved state
            is not this model's, or another optimizer's without ``--switch-optimizer``.
    """
    if model is None:
        model = models.build(config.model, seed=config.seed)
    make_tables(model, config.table_rows)  # --table-rows: large dense embeddings too
    whole, flat = initial_weights(model)
    manifest, flat, offset = _shard_of(config, whole, flat)
    tables, frozen = _tables_and_frozen(config, model)
    if resume and snapshot is None and config.checkpoint_dir:
        snapshot = saved_state(
            config.checkpoint_dir,
            manifest,
            config.shard,
            config.shards,
            config.cuts,
            config.model,
        )
        directory = Path(config.checkpoint_dir)
        if snapshot is None and reshard.resume_other(
            directory, whole, frozen, config.shard, config.shards
        ):  # another --shards wrote them: this shard's part, re-partitioned
            snapshot = saved_state(
                directory, manifest, config.shard, config.shards, config.cuts, config.model
            )
    if tables is not None and snapshot is None:  # a resume takes the checkpoint's rows
        tables.start_from(own_rows(model))  # a module's own rows; declared tables seeded
    optimizer = config.outer_optimizer()
    grouping = None
    if optimizer.user:  # --optimizer module:function
        grouping = user_optimizer.grouping(optimizer, model, whole, offset, manifest)
    store = ParameterStore(
        manifest,
        flat,
        optimizer,
        config.server_device,
        copy=pieces.copy,
        switch=config.switch_optimizer,
        decayed=step_rules.decayed_ranges(model, whole, offset, manifest.section("param")[1])
        if optimizer.decay_on == "matrices"
        else (),
        grouped=grouping,
    )
    if snapshot is not None:  # another optimizer's: refused before the coordinator logs a resume
        where = f" in {config.checkpoint_dir}" if config.checkpoint_dir else ""
        store.resumes(snapshot.optimizer_state, f"The checkpoint{where}")
    return Coordinator(
        config,
        store,
        now,
        tables=tables,
        frozen=frozen,
        model_numel=whole.numel,
        shard_offset=offset,
        snapshot=snapshot,
    )


def _shard_of(
    config: ServerConfig, manifest: Manifest, flat: np.ndarray
) -> tuple[Manifest, np.ndarray, int]:
    """This server's range of the whole model's ``manifest`` and ``flat`` weights, and
    where it starts (one contiguous range of the flat buffer; the whole of it unsharded).

    Raises:
        ConfigError: the model cannot be split into ``config.shards``.
    """
    if config.shards <= 1:
        return manifest, flat, 0
    offset, end = shard_range(manifest.numel, config.shard, config.shards)
    if end <= offset:
        raise ConfigError(
            f"A model of {manifest.numel} parameters cannot be split into {config.shards} shards."
        )
    return shard_manifest(manifest, offset, end), flat[offset:end].copy(), offset


def _tables_and_frozen(
    config: ServerConfig, model: nn.Module
) -> tuple[TableSet | None, dict[str, Any]]:
    """This shard's rows of every sparse table of ``model`` (None: it has none), and its
    frozen parameters (kept unsharded, so that a checkpoint's model_state_dict loads
    strictly)."""
    tables, frozen = None, {}
    specs = models.table_specs(model)
    if config.table_optimizer.strip() and not specs:
        raise ConfigError(
            f"--table-optimizer {config.table_optimizer!r} is set, but the model holds no "
            "sparse table (an nn.Embedding or nn.EmbeddingBag with sparse=True, or one of "
            "--table-rows rows or more)."
        )
    if specs:
        chosen = parse_table_optimizers(config.table_optimizer)
        declared, lifecycles = declared_choices(model)  # sparse.Embedding's own
        dense = config.optimizer.name
        if config.optimizer.user:  # the rows' optimizer that stands for the user's class
            dense = user_optimizer.row_kind(config.optimizer, model)
        try:
            optimizers = table_optimizers(specs, chosen, dense, config.optimizer.lr, declared)
        except ValueError as exc:  # a user's optimizer that no row-wise one stands for
            if isinstance(exc, ConfigError) or not config.optimizer.user:
                raise
            raise ConfigError(
                f"--optimizer {config.optimizer.name} is not Adam, AdamW or SGD, which a "
                "table's row-wise optimizer stands for: name each table's with "
                "--table-optimizer (for example 'sparse-adam:0.01')."
            ) from None
        tables = TableSet(specs, optimizers, config.seed, config.shard, config.shards, lifecycles)
        fix_mmap_threshold(SERVER_MMAP_THRESHOLD)  # grown-out table arrays go back when freed
    if config.shards == 1:
        frozen = {
            n: p.detach().cpu().clone() for n, p in model.named_parameters() if not p.requires_grad
        }
    return tables, frozen
