"""What a resumed server's optimizer takes from a checkpoint: the state of the same
optimizer, never the settings it was written with (the command line's win, and the log says
which changed); another optimizer's state is refused, or with ``--switch-optimizer`` left
behind, the optimizer starting afresh.

A checkpoint's ``optimizer_state`` is the torch optimizer's ``state_dict()`` and, under
``SETTINGS``, the ``OptimizerConfig`` that wrote it (``recorded``). One from before that
record names its optimizer only through its parameter group (``saved``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paramserver.config import OptimizerConfig
from paramserver.errors import ConfigError

SETTINGS = "settings"  # the optimizer_state key of the settings that wrote it
_MOMENTUM = ("momentum", "nesterov", "delayed-nesterov")  # the optimizers that read --momentum


def recorded(cfg: OptimizerConfig) -> dict[str, Any]:
    """``cfg`` as a checkpoint records it beside the optimizer's state: plain values by
    field name (``torch.load(weights_only=True)`` reads them back)."""
    return {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(OptimizerConfig)
        if "flag" in f.metadata  # not ``factory``, a callable
    }


def saved(state: dict[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The optimizers that may have written ``state`` (one, unless an older checkpoint's
    parameter group fits several) and the settings it was written with: all of them as
    recorded, or what an older checkpoint's group holds (momentum, weight decay, period;
    its ``lr`` is only the last step's rate, the schedule's, not the setting)."""
    record = state.get(SETTINGS)
    if isinstance(record, dict) and record.get("name"):
        return (str(record["name"]),), dict(record)
    groups = state.get("param_groups") or [{}]
    group = groups[0]
    settings = {k: group[k] for k in ("momentum", "weight_decay", "period") if k in group}
    return _kinds(group), settings


def _kinds(group: dict[str, Any]) -> tuple[str, ...]:
    """The optimizers whose torch optimizer holds parameter group ``group``."""
    if "period" in group:
        return ("delayed-nesterov",)
    if "betas" in group:  # torch before 2.6 told AdamW from Adam by its class alone
        if "decoupled_weight_decay" not in group:
            return ("adam", "adamw")
        return ("adamw",) if group["decoupled_weight_decay"] else ("adam",)
    if group.get("nesterov"):
        return ("nesterov",)
    return ("momentum",) if group.get("momentum") else ("sgd", "momentum")


def check(state: dict[str, Any], cfg: OptimizerConfig, switch: bool, where: str) -> bool:
    """Whether the optimizer of ``cfg`` goes on from ``state`` (a checkpoint's, read from
    ``where``): True for the same optimizer; False for another under ``switch``
    (``--switch-optimizer``: its state is left behind).

    Raises:
        ConfigError: another optimizer wrote ``state`` and ``switch`` is not given.
    """
    kinds, _ = saved(state)
    if cfg.name in kinds or switch:
        return cfg.name in kinds
    theirs = " or ".join(kinds)
    raise ConfigError(
        f"{where} was written by a server of --optimizer {theirs}, whose state --optimizer "
        f"{cfg.name} cannot go on from: give --switch-optimizer to start {cfg.name}'s state "
        f"afresh (the weights and the rest of the run go on), or resume with --optimizer "
        f"{kinds[0]}."
    )


def changes(state: dict[str, Any], cfg: OptimizerConfig) -> list[str]:
    """The settings of ``cfg`` that differ from those ``state`` was written with, each as
    ``--option old -> new``, of those its optimizer reads."""
    _, before = saved(state)
    out = []
    for f in dataclasses.fields(OptimizerConfig):
        if f.name == "name" or f.name not in before or "flag" not in f.metadata:
            continue
        if f.name == "momentum" and cfg.name not in _MOMENTUM:
            continue
        old, new = before[f.name], getattr(cfg, f.name)
        if old != new:
            out.append(f"{f.metadata['flag'].flag} {old} -> {new}")
    return out
