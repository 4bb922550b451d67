"""The small Python API: run a server in-process and join it from a training loop."""

from __future__ import annotations

from typing import Any

from torch import nn

from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.server.app import ServerApp


def serve(
    model: str | nn.Module = "mlp",
    *,
    optimizer: str = "adam",
    lr: float = 1e-3,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    lr_schedule: str = "constant",
    lr_total_steps: int | None = None,
    policy: str = "delay-1",
    workers: int = 1,
    host: str = "127.0.0.1",
    port: int = 0,
    seed: int = 0,
    **settings: Any,
) -> ServerApp:
    """Start a parameter server in this process and return it, serving.

    Args:
        model: a factory name ("mlp", "cnn", "module:function") or a model whose current
            weights start the run.
        optimizer: "sgd", "momentum", "adam" or "adamw", applied on the server.
        lr, momentum, weight_decay: the optimizer's settings.
        lr_schedule, lr_total_steps: "constant", or "cosine" decay to 0 over
            ``lr_total_steps`` optimizer steps.
        policy: "sync", "delay-1", "ssp:K" or "async".
        workers: how many workers the run waits for before the first pull is answered;
            also the most that may be live at once.
        host, port: where to listen; port 0 picks a free port (see ``.address``).
        seed: seeds the initial weights of a named model.
        **settings: any other ServerConfig field (lease_seconds, batch_size, ...).

    Returns:
        The running server: ``.address``, ``.status()``, ``.stop()``.
    """
    name = model if isinstance(model, str) else ""
    config = ServerConfig(
        model=name,
        optimizer=OptimizerConfig(
            optimizer, lr, momentum, weight_decay, lr_schedule, lr_total_steps
        ),
        policy=policy,
        workers=workers,
        host=host,
        port=port,
        seed=seed,
        **settings,
    )
    return ServerApp(config, None if isinstance(model, str) else model).start()
