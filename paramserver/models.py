"""Model factories, by name or by ``module:function``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paramserver.errors import ConfigError


def mlp() -> nn.Module:
    """784-256-128-10 multilayer perceptron for 28x28 images."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def cnn() -> nn.Module:
    """A small two-convolution network for 28x28 images."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


FACTORIES: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "cnn": cnn}


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


def import_function(spec: str, what: str) -> Callable[[], Any]:
    """The function ``module:function`` names, for a ``what`` (model, dataset).

    Raises:
        ConfigError: the module cannot be imported or has no such function.
    """
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure to import gets the same sentence
        raise ConfigError(
            f"Cannot import module {module_name!r} for {what} {spec!r}: {exc}."
        ) from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(
            f"Module {module_name!r} has no function {func_name!r} ({what} {spec!r})."
        )
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

    Raises:
        ConfigError: an embedding makes sparse gradients, which the flat buffer cannot carry.
    """
    for name, module in model.named_modules():
        sparse = isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.sparse
        if sparse and module.weight.requires_grad:
            raise ConfigError(
                f"Parameter {name + '.weight'!r} belongs to an {type(module).__name__} with "
                "sparse=True, whose sparse gradients paramserver cannot carry yet: build it "
                "with sparse=False (dense gradients), or freeze it (requires_grad=False)."
            )
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
