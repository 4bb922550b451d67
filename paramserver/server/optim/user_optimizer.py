"""A user's optimizer (``--optimizer module:function``, ``ps.serve(optimizer=callable)``),
issue 56 must 2.
The function takes the model's named parameters (``model.named_parameters()``, the
trainable ones) and returns a ``torch.optim.Optimizer`` with its parameter groups, as users
write ``AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, ...}], ...)``. The
server calls it once on its own model, learns each parameter's group by identity, and
builds the same optimizer class with the same groups' settings over the pieces of the flat
buffer that its shard holds (``Pieces``): a piece is a view of the flat parameters, in its
tensor's shape where the shard holds the whole tensor (per-tensor rules such as
Adafactor's see the tensor), 1-D otherwise. So per-group rates, decay, betas and eps hold,
and torch skips a piece whose gradient is None (its own step count stays).

Its state checkpoints in the flat form every other server optimizer has
(``flat_state``): per-element state joined in flat order (zeros where a piece has none),
the largest step, and each piece's own step beside it, so resume and reshard work as today.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paramserver.codec.idle import Idle
from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig
from paramserver.errors import ConfigError
from paramserver.models import import_function

PIECES = "pieces"  # the optimizer_state key of each piece's layout and step

Factory = Callable[[Iterable[tuple[str, nn.Parameter]]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of a shard's parameters: all or part of one tensor, in group
    ``group`` (-1: the user's optimizer holds it in none: never stepped)."""

    name: str
    lo: int
    hi: int
    shape: tuple[int, ...] | None  # the tensor's shape where the piece is all of it
    group: int


def groups_of(
    factory: Factory, model: nn.Module, spec: str = "the optimizer factory"
) -> tuple[torch.optim.Optimizer, dict[str, int]]:
    """The user's optimizer over ``model`` and each trainable parameter's group by name (a
    parameter in none is left out). Raises ConfigError in one line for a factory that
    fails, returns something else, or names a parameter twice or one not of the model."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    try:
        opt = factory(iter(named))
    except Exception as exc:  # noqa: BLE001 - the user's code: one line, naming it
        raise ConfigError(f"{spec} failed: {exc!r}.") from None
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"{spec} returned {type(opt).__name__}, not a torch.optim.Optimizer.")
    by_id = {id(p): n for n, p in named}
    group: dict[str, int] = {}
    for g, params in enumerate(opt.param_groups):
        for p in params["params"]:
            name = by_id.get(id(p))
            if name is None:
                raise ConfigError(
                    f"{spec}'s optimizer holds a tensor that is not a trainable parameter of "
                    "the model it was given."
                )
            if name in group:
                raise ConfigError(f"{spec}'s optimizer holds parameter {name!r} twice.")
            group[name] = g
    return opt, group


def pieces(
    specs: Sequence[tuple[str, int, int, tuple[int, ...]]],
    group: dict[str, int],
    lo: int,
    hi: int,
) -> list[Piece]:
    """The pieces of a shard of elements [lo, hi): ``specs`` are the model's trainable
    parameters in flat order, (name, start, numel, shape)."""
    out = []
    for name, start, numel, shape in specs:
        a, b = max(start, lo), min(start + numel, hi)
        if a < b:
            whole = a == start and b == start + numel
            out.append(Piece(name, a - lo, b - lo, shape if whole else None, group.get(name, -1)))
    return out


# What a store builds a user's optimizer from: the factory's optimizer (its class and
# groups' settings) and this shard's pieces
Grouping = tuple[torch.optim.Optimizer, Sequence[Piece]]


class GroupedOptimizer:
    """The user's optimizer class and groups over ``flat`` (a shard's parameters)."""

    def __init__(self, template: torch.optim.Optimizer, parts: Sequence[Piece], flat: torch.Tensor):
        self.pieces = list(parts)
        self.params = [
            nn.Parameter(flat[p.lo : p.hi].view(p.shape) if p.shape else flat[p.lo : p.hi])
            for p in self.pieces
        ]
        groups = []
        self.slots: list[int] = []  # the piece of each parameter of the optimizer, in order
        for g, settings in enumerate(template.param_groups):
            members = [i for i, p in enumerate(self.pieces) if p.group == g]
            if not members:  # a group this shard holds nothing of: the settings only
                continue
            groups.append(
                {
                    **{k: v for k, v in settings.items() if k != "params"},
                    "params": [self.params[i] for i in members],
                }
            )
            self.slots += members
        self.initial_lr = [float(g.get("initial_lr", g["lr"])) for g in groups]
        self.optimizer = _same_class(template, groups)

    def step(self, grad: torch.Tensor, factor: float = 1.0, idle: Idle = ()) -> None:
        """One step with ``grad`` (the shard's flat gradient): each group at its own rate
        times ``factor`` (the schedule's), a piece wholly in ``idle`` without a gradient
        (torch skips it)."""
        skip = _wholly_idle(self.pieces, idle)
        for i, (piece, param) in enumerate(zip(self.pieces, self.params, strict=True)):
            if i in skip or piece.group < 0:
                param.grad = None
            else:
                g = grad[piece.lo : piece.hi]
                param.grad = g.view(piece.shape) if piece.shape else g
        for group, lr in zip(self.optimizer.param_groups, self.initial_lr, strict=True):
            group["lr"] = lr * factor
        self.optimizer.step()
        for param in self.params:
            param.grad = None

    def flat_state(self, n: int) -> dict[str, Any]:
        """The state in the flat form of the other server optimizers: ``state[0]`` per key
        one tensor of ``n`` elements (zeros where a piece has none) and ``step`` the
        largest, ``param_groups`` the first group's settings, and under ``pieces`` each
        piece's (name, lo, hi, step) (step -1: no state yet)."""
        flat: dict[str, torch.Tensor] = {}
        layout: list[list[Any]] = []
        counts = False  # counts: the optimizer keeps a step count (SGD: none)
        for piece, param in zip(self.pieces, self.params, strict=True):
            state = self.optimizer.state.get(param, {})
            step = float(state.get("step", 0.0)) if state else -1.0
            counts = counts or "step" in state
            layout.append([piece.name, piece.lo, piece.hi, step])
            for key, value in state.items():
                if (
                    key != "step"
                    and torch.is_tensor(value)
                    and value.numel() == piece.hi - piece.lo
                ):
                    into = flat.setdefault(
                        key, torch.zeros(n, dtype=value.dtype, device=value.device)
                    )
                    into[piece.lo : piece.hi] = value.reshape(-1)
        held = [float(row[3]) for row in layout if row[3] >= 0]
        one: dict[str, Any] = {k: v.cpu() for k, v in flat.items()}
        if held and counts:
            one["step"] = torch.tensor(max(held))
        first = self.optimizer.param_groups[0] if self.optimizer.param_groups else {}
        settings = {k: v for k, v in first.items() if k != "params"}
        return {
            "state": {0: one} if one else {},
            "param_groups": [{**settings, "params": [0]}],
            PIECES: layout,
        }

    def load_flat(self, saved: dict[str, Any]) -> None:
        """The state ``flat_state`` gave, or a reshard of it (its pieces moved to this
        shard: ``reshard_plan``): each piece its own step, by its tensor's name where the
        saved pieces are cut otherwise; the flat ``step`` where none are saved."""
        one = saved.get("state", {}).get(0, {})
        layout = saved.get(PIECES)
        mine = [[p.name, p.lo, p.hi] for p in self.pieces]
        if layout is not None and [row[:3] for row in layout] == mine:
            steps = [float(row[3]) for row in layout]
        elif layout is not None:  # a tensor's pieces step together: its idle ranges are whole
            by_name: dict[str, float] = {}
            for name, _, _, step in layout:
                by_name[name] = max(by_name.get(name, -1.0), float(step))
            steps = [by_name.get(p.name, -1.0) for p in self.pieces]
        else:
            steps = [float(one["step"]) if "step" in one else -1.0] * len(self.pieces)
        self.optimizer.state.clear()
        for piece, param, step in zip(self.pieces, self.params, steps, strict=True):
            if step < 0 or piece.group < 0:
                continue
            state: dict[str, Any] = {"step": torch.tensor(step)} if "step" in one else {}
            for key, value in one.items():
                if key != "step" and torch.is_tensor(value):
                    part = value[piece.lo : piece.hi]
                    state[key] = part.reshape(param.shape).to(param.device).clone()
            self.optimizer.state[param] = state


def _same_class(
    template: torch.optim.Optimizer, groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """``type(template)`` over ``groups``: with its defaults where the constructor takes
    them, else from the groups' own settings alone."""
    kind: Any = type(template)
    try:
        return kind(groups, **template.defaults)  # type: ignore[no-any-return]
    except TypeError:
        return kind(groups)  # type: ignore[no-any-return]


def _wholly_idle(parts: Sequence[Piece], idle: Idle) -> set[int]:
    """The pieces every element of which lies in a range of ``idle``."""
    out = set()
    for i, p in enumerate(parts):
        if any(a <= p.lo and p.hi <= b for a, b in idle):
            out.add(i)
    return out


def factory_of(cfg: OptimizerConfig) -> Factory:
    """The factory ``cfg`` names: the callable ``ps.serve`` was given, or the function of
    ``--optimizer module:function``."""
    if cfg.factory is not None:
        return cfg.factory
    return import_function(cfg.name, "optimizer", arguments=1)


def grouping(
    cfg: OptimizerConfig, model: nn.Module, whole: Manifest, offset: int, shard: Manifest
) -> Grouping:
    """What a shard's store builds the user's optimizer from: the factory's optimizer over
    ``model`` and the pieces of the shard's parameters (from ``offset`` of ``whole``'s
    flat buffer, ``shard``'s parameters long)."""
    template, group = groups_of(factory_of(cfg), model, f"--optimizer {cfg.name}")
    specs = [(t.name, t.start, t.numel, tuple(t.shape)) for t in whole.tensors if t.role == "param"]
    n = shard.section("param")[1]
    return template, pieces(specs, group, offset, offset + n)


def row_kind(cfg: OptimizerConfig, model: nn.Module) -> str:
    """The built-in optimizer whose row-wise form a table takes under the user's: adam for
    Adam and AdamW (sparse-adam), sgd for SGD; "" for another class (a table then needs
    its optimizer named with --table-optimizer)."""
    template, _ = groups_of(factory_of(cfg), model, f"--optimizer {cfg.name}")
    if isinstance(template, torch.optim.Adam | torch.optim.AdamW):
        return "adam"
    return "sgd" if isinstance(template, torch.optim.SGD) else ""
