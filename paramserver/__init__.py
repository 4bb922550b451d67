"""paramserver: an asynchronous parameter server for data-parallel PyTorch training.

Public API::

    import paramserver as ps
    server = ps.serve("mlp", optimizer="adam", lr=1e-3, policy="delay-1", port=0)
    worker = ps.Worker(server.address, model)   # loads the server's weights into model
    ...
    loss.backward(); worker.step()              # push gradients, pull weights
    worker.close(); server.stop()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The public names, loaded on first use: `paramserver status` and `health` never import torch.
_LAZY = {
    "serve": "paramserver.api",
    "load_checkpoint": ("paramserver.checkpoint", "load"),
    "LaunchConfig": "paramserver.config",
    "OptimizerConfig": "paramserver.config",
    "Security": "paramserver.config",
    "ServerConfig": "paramserver.config",
    "WorkerConfig": "paramserver.config",
    "ClusterFull": "paramserver.errors",
    "ConfigError": "paramserver.errors",
    "DataUnavailable": "paramserver.errors",
    "InvalidRequest": "paramserver.errors",
    "OutOfOrder": "paramserver.errors",
    "ParamServerError": "paramserver.errors",
    "ServerUnavailable": "paramserver.errors",
    "Timeout": "paramserver.errors",
    "Unauthenticated": "paramserver.errors",
    "UnknownWorker": "paramserver.errors",
    "WrongIncarnation": "paramserver.errors",
    "ServerApp": "paramserver.server.app",
    "Policy": "paramserver.staleness",
    "ShardedWorker": "paramserver.worker.worker",
    "Worker": "paramserver.worker.worker",
}
_SUBMODULES = ("models", "data", "checkpoint", "codec", "settings")

if TYPE_CHECKING:
    from paramserver.api import serve
    from paramserver.checkpoint import load as load_checkpoint
    from paramserver.config import (
        LaunchConfig,
        OptimizerConfig,
        Security,
        ServerConfig,
        WorkerConfig,
    )
    from paramserver.errors import (
        ClusterFull,
        ConfigError,
        DataUnavailable,
        InvalidRequest,
        OutOfOrder,
        ParamServerError,
        ServerUnavailable,
        Timeout,
        Unauthenticated,
        UnknownWorker,
        WrongIncarnation,
    )
    from paramserver.server.app import ServerApp
    from paramserver.staleness import Policy
    from paramserver.worker.worker import ShardedWorker, Worker


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"paramserver.{name}")
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'paramserver' has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "ClusterFull",
    "ConfigError",
    "DataUnavailable",
    "InvalidRequest",
    "LaunchConfig",
    "OptimizerConfig",
    "OutOfOrder",
    "ParamServerError",
    "Policy",
    "Security",
    "ServerApp",
    "ServerConfig",
    "ServerUnavailable",
    "ShardedWorker",
    "Timeout",
    "Unauthenticated",
    "UnknownWorker",
    "Worker",
    "WorkerConfig",
    "WrongIncarnation",
    "load_checkpoint",
    "serve",
]
