"""paramserver: an asynchronous parameter server for data-parallel PyTorch training.

Public API::

    import paramserver as ps
    server = ps.serve("mlp", optimizer="adam", lr=1e-3, policy="delay-1", port=0)
    worker = ps.Worker(server.address, model)   # loads the server's weights into model
    ...
    loss.backward(); worker.step()              # push gradients, pull weights
    worker.close(); server.stop()
"""

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
