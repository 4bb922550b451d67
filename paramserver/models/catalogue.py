"""A model by name or by ``module:function``, and what the servers learn from it: its
trainable parameters in order, its sparse tables, its state buffers and their roles."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paramserver.codec.layout import Manifest
from paramserver.codec.rows import TableSpec
from paramserver.errors import ConfigError
from paramserver.models.zoo import FACTORIES


def resolve(spec: str) -> Callable[[], nn.Module]:
    """The factory for ``spec``: a built-in name or ``module:function``.

    Raises:
        ConfigError: the name is unknown or the function cannot be imported.
    """
    if spec in FACTORIES:
        return FACTORIES[spec]
    if ":" not in spec:
        raise ConfigError(
            f"Unknown model {spec!r}: use one of {', '.join(FACTORIES)} or 'module:function'."
        )
    return import_function(spec, "model")


def _import_here(name: str) -> Any:
    """``import name``, finding a module of the current folder as ``python -m`` does (the
    ``paramserver`` script's own folder is on ``sys.path``, the current one is not)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        if exc.name != name.split(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.insert(0, here)
        return importlib.import_module(name)


def import_function(spec: str, what: str, arguments: int = 0) -> Callable[..., Any]:
    """The function ``module:function`` names, for a ``what`` (model, dataset, loss) called
    with ``arguments`` positional arguments.

    Raises:
        ConfigError: the module cannot be imported or has no such function.
    """
    module_name, _, func_name = spec.partition(":")
    try:
        module = _import_here(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure to import gets the same sentence
        where = f"the current folder ({os.getcwd()}) and PYTHONPATH"
        raise ConfigError(
            f"Cannot import module {module_name!r} for {what} {spec!r}: {exc} (looked in {where})."
        ) from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(
            f"Module {module_name!r} has no function {func_name!r} ({what} {spec!r})."
        )
    try:
        inspect.signature(func).bind(*[None] * arguments)
    except TypeError as exc:  # os:system and the like: not a factory
        called = f"with {arguments} arguments" if arguments else "without arguments"
        kind = what if arguments else f"{what} factory"
        raise ConfigError(
            f"--{what} {spec!r} is not a {kind}: it cannot be called {called} ({exc})."
        ) from None
    except ValueError:  # no signature to read (some builtins): calling it will tell
        pass
    return func


def build(spec: str, seed: int | None = None) -> nn.Module:
    """Build the model named by ``spec``; with ``seed``, its initial weights are reproducible."""
    factory = resolve(spec)
    if seed is not None:
        torch.manual_seed(seed)
    model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"Model factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module."
        )
    return model


def parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainable parameters, in the order that defines the flat buffer. Frozen ones
    (``requires_grad=False``) are left out: never pushed, never updated, no bytes on the wire.
    So are the weights of sparse embeddings (``sparse=True``): the servers hold them as
    tables, row by row (``table_specs``).

    Raises:
        ConfigError: a parameter is not floating-point, or a sparse embedding a table cannot
            stand in for.
    """
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise ConfigError(
                f"Parameter {name!r} has dtype {str(p.dtype).removeprefix('torch.')}: "
                "paramserver carries floating-point parameters only. Register it as a buffer "
                "(module.register_buffer) instead."
            )
    tables = {f"{t.name}.weight".lstrip(".") for t in table_specs(model)}
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in tables]


def table_specs(model: nn.Module) -> list[TableSpec]:
    """The tables of ``model``: one per trainable sparse embedding, named by its module path.

    Raises:
        ConfigError: an embedding a table cannot stand in for (the message names it).
    """
    from paramserver.sparse.embedding import table_specs as specs

    try:
        return specs(model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def buffers(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """The buffers that are part of the run's state, with their roles: the persistent ones
    (those ``state_dict`` holds), floating-point first ("buffer": the server keeps the mean
    over workers), then integer ones ("count": the server keeps the largest value)."""
    persistent = set(model.state_dict(keep_vars=True))
    named = [(n, b) for n, b in model.named_buffers() if n in persistent]
    floats = [(n, b, "buffer") for n, b in named if b.is_floating_point()]
    return floats + [(n, b, "count") for n, b in named if not b.is_floating_point()]


def state(model: nn.Module) -> tuple[Manifest, list[torch.Tensor]]:
    """The layout of ``model``'s run state (trainable parameters, then buffers) as the flat
    buffer, and its tensors in that order.

    Raises:
        ConfigError: a parameter or buffer paramserver cannot carry (the message names it).
    """
    named = [(n, p, "param") for n, p in parameters(model)] + buffers(model)
    manifest = Manifest.from_tensors([(n, t) for n, t, _ in named], [r for _, _, r in named])
    return manifest, [t for _, t, _ in named]


def aliases(model: nn.Module) -> dict[str, str]:
    """The second names of tensors ``model`` holds under several (a head tied to the token
    embedding, a shared submodule): ``{alias: the first name}``, the first being the one
    the servers carry (``named_parameters`` and ``state_dict`` go in the same order)."""
    first: dict[int, str] = {}
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = id(t)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def with_aliases(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``state`` with each alias of ``names`` (``aliases``) set to its first name's tensor,
    so that ``load_state_dict(strict=True)`` finds every name and the trained values under
    each (a dict taken from a fresh model's ``state_dict`` held the alias at its initial
    values, and loading it overwrote the trained embedding)."""
    out = dict(state)
    for alias, name in names.items():
        if name in out:
            out[alias] = out[name]
    return out


def state_difference(model: nn.Module, state: dict[str, Any]) -> str:
    """How ``state`` fails to load into ``model`` (``load_state_dict(strict=True)``), in one
    line, at most three names of each kind; "" when it loads (torch's own message is many
    lines, every key)."""
    own, given = model.state_dict(), state

    def some(names: list[str]) -> str:
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return ", ".join(repr(n) for n in names[:3]) + more

    parts = []
    if missing := [k for k in own if k not in given]:
        parts.append(f"missing {some(missing)}")
    if unexpected := [k for k in given if k not in own]:
        parts.append(f"unexpected {some(unexpected)}")
    shapes = [
        f"{k!r} is {list(given[k].shape)} there, {list(own[k].shape)} in the model"
        for k in own
        if k in given
        and hasattr(given[k], "shape")
        and tuple(given[k].shape) != tuple(own[k].shape)
    ]
    if shapes:
        parts.append(
            "; ".join(shapes[:3]) + (f" and {len(shapes) - 3} more" if len(shapes) > 3 else "")
        )
    return "; ".join(parts)
