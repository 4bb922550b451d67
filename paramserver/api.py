"""The small Python API: run a server in-process and join it from a training loop."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.server.app import ServerApp
from paramserver.settings import values

# Where ``serve`` listens unless told: this host only, any free port (``.address``).
LOCAL: dict[str, Any] = {"host": "127.0.0.1", "port": 0}


def serve(
    model: str | nn.Module | None = None,
    *,
    config: ServerConfig | None = None,
    **settings: Any,
) -> ServerApp:
    """Start a parameter server in this process and return it, serving.

    Args:
        model: a factory name ("mlp", "cnn", "module:function") or a model whose current
            weights start the run [default: the config's model, "mlp"].
        config: the whole ServerConfig [default: ServerConfig's defaults, listening on
            127.0.0.1, any free port]; the settings given as well replace its fields.
        **settings: any ServerConfig field by name: policy ("sync", "delay-1", "ssp:K" or
            "async"), workers (joins the run waits for before the first pull is
            answered; also the most that may be live at once), host and port (port 0: a
            free port), seed (of a named model's initial weights), lease_seconds,
            batch_size, security, server_device ("cpu", "cuda", "cuda:I": where the
            weights and the optimizer live), ...; and the optimizer's by the names of its
            options:
            optimizer ("sgd", "momentum", "nesterov", "delayed-nesterov", "adam" or
            "adamw"; your factory, a function that takes the model's named parameters and
            returns a torch.optim.Optimizer with its parameter groups, or its
            "module:function"; or a whole OptimizerConfig),
            lr, momentum, weight_decay, lr_schedule and lr_total_steps ("constant", or
            "cosine" or "linear" decay to lr_floor (a fraction of lr) over that many
            optimizer steps), lr_warmup (steps of linear warmup first), nesterov_period
            (delayed-nesterov's N).

    Returns:
        The running server: ``.address``, ``.status()``, ``.stop()``.
    """
    base = config or ServerConfig(**LOCAL)
    optimizer = base.optimizer
    given = settings.get("optimizer")
    if isinstance(given, OptimizerConfig):
        optimizer = settings.pop("optimizer")
    elif callable(given):  # the user's factory, named by where it is defined
        settings["optimizer"] = f"{given.__module__}:{given.__qualname__}"
        optimizer = dataclasses.replace(optimizer, factory=given)
    chosen = values(OptimizerConfig, settings)  # optimizer, lr, lr_schedule, ...
    if chosen:
        optimizer = dataclasses.replace(optimizer, **chosen)
    name = model if isinstance(model, str) else base.model if model is None else ""
    cfg = dataclasses.replace(base, model=name, optimizer=optimizer, **settings)
    return ServerApp(cfg, model if isinstance(model, nn.Module) else None).start()
