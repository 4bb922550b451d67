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
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

# The public names, loaded on first use: `paramserver status` and `health` never import torch.
_LAZY = {
    "serve": "paramserver.api",
    "load_checkpoint": ("paramserver.server.disk.checkpoint", "load"),
    "model_state_dict": "paramserver.cluster.reading",
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
    "RejoinRequired": "paramserver.errors",
    "ServerRewound": "paramserver.errors",
    "ServerUnavailable": "paramserver.errors",
    "Timeout": "paramserver.errors",
    "Unauthenticated": "paramserver.errors",
    "UnknownWorker": "paramserver.errors",
    "WrongIncarnation": "paramserver.errors",
    "ServerApp": "paramserver.server.app",
    "Policy": "paramserver.policy.staleness",
    "ShardedWorker": "paramserver.worker.worker",
    "Worker": "paramserver.worker.worker",
    "LocalSteps": "paramserver.training.local_steps",
}
_SUBMODULES = {
    "models": "paramserver.models",
    "data": "paramserver.training.data",
    "checkpoint": "paramserver.server.disk.checkpoint",
    "codec": "paramserver.codec",
    "settings": "paramserver.settings",
    "serving": "paramserver.serving",
    "sparse": "paramserver.sparse",
}

# Where the modules of the flat layout went: ``import paramserver.launch`` (users' scripts,
# notebooks, pickles of our classes) still works and gives the module in its new home.
MOVED = {
    "paramserver.checkpoint": "paramserver.server.disk.checkpoint",
    "paramserver.clicks": "paramserver.training.clicks",
    "paramserver.data": "paramserver.training.data",
    "paramserver.dataplan": "paramserver.server.bookkeeping.batch_queue",
    "paramserver.evaluation": "paramserver.training.evaluation",
    "paramserver.export": "paramserver.server.disk.export",
    "paramserver.launch": "paramserver.cluster.launch",
    "paramserver.membership": "paramserver.server.bookkeeping.leases",
    "paramserver.procs": "paramserver.cluster.procs",
    "paramserver.roles": "paramserver.cluster.roles",
    "paramserver.rundir": "paramserver.cluster.rundir",
    "paramserver.security": "paramserver.transport.security",
    "paramserver.server.health": "paramserver.transport.health",
    "paramserver.shm": "paramserver.transport.shm",
    "paramserver.sparse.wire": "paramserver.codec.rows",
    "paramserver.staleness": "paramserver.policy.staleness",
    "paramserver.statusview": "paramserver.cli.statusview",
    "paramserver.store": "paramserver.server.bookkeeping.store",
    "paramserver.stub": "paramserver.transport.stub",
    "paramserver.worker.channel": "paramserver.transport.channels",
    "paramserver.worker.trainer": "paramserver.training.trainer",
}

# The server folder's modules before it was split into rooms (stage 4): checkpoints
# pickled or scripts written against ``paramserver.server.checkpoint`` and the like still load.
_SERVER_ROOMS = {
    "answers": "engine.answers",
    "applier": "doors.optimizer_thread",
    "applies": "engine.dense_apply",
    "arrival": "engine.arrival",
    "buffers": "bookkeeping.buffers",
    "checkpoint": "disk.checkpoint",
    "checkpointer": "disk.checkpoint_writer",
    "checks": "engine.checks",
    "coordinator": "engine.coordinator",
    "cuts": "bookkeeping.cuts",
    "dataplan": "bookkeeping.batch_queue",
    "dataport": "doors.dataport",
    "doorbell": "doors.doorbell",
    "export": "disk.export",
    "ledger": "bookkeeping.ledger",
    "listener": "doors.listener",
    "members": "engine.members",
    "membership": "bookkeeping.leases",
    "payloads": "doors.payloads",
    "pulls": "engine.pulls",
    "repartition": "disk.reshard_plan",
    "reshard": "disk.reshard",
    "rounds": "bookkeeping.sync_round",
    "rowchain": "disk.row_reader",
    "rowfiles": "disk.row_format",
    "rowlog": "disk.row_writer",
    "saves": "bookkeeping.write_record",
    "saving": "engine.saving",
    "servicer": "doors.servicer",
    "state": "bookkeeping.snapshot",
    "status": "bookkeeping.status",
    "steps": "doors.steps",
    "store": "bookkeeping.store",
}
MOVED.update(
    {f"paramserver.server.{old}": f"paramserver.server.{new}" for old, new in _SERVER_ROOMS.items()}
)

# bench/ before its families (stage 4; ``paramserver.bench.criteo`` is a family now).
_BENCH_FAMILIES = {
    "accuracy": "throughput.accuracy",
    "criteo_bench": "criteo.case",
    "criteo_model": "criteo.model",
    "criteo_ranks": "criteo.ranks",
    "figures": "report.figures",
    "netrain": "wire.network_training",
    "network": "wire.network",
    "pusher": "wire.pusher",
    "readme": "report.readme",
    "results": "report.results",
    "scaling": "throughput.scaling",
    "server": "wire.server",
    "sparse": "tables.sparse",
    "sparse_ranks": "tables.ranks",
    "sparse_rows": "tables.row_memory",
    "step": "throughput.step",
    "straggler": "throughput.straggler",
    "transport": "wire.transport",
    "wakeup": "wire.wakeup",
}
MOVED.update(
    {f"paramserver.bench.{old}": f"paramserver.bench.{new}" for old, new in _BENCH_FAMILIES.items()}
)


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module path with the module at its new one (the same object)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system sets __spec__ to ours next
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran at its new path already: give it back its own spec."""
        alias = module.__spec__
        if alias is not None and alias.loader_state is not None:
            module.__spec__ = alias.loader_state


if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
    sys.meta_path.append(_Moved())

if TYPE_CHECKING:
    from paramserver.api import serve
    from paramserver.cluster.reading import model_state_dict
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
        RejoinRequired,
        ServerRewound,
        ServerUnavailable,
        Timeout,
        Unauthenticated,
        UnknownWorker,
        WrongIncarnation,
    )
    from paramserver.policy.staleness import Policy
    from paramserver.server.app import ServerApp
    from paramserver.server.disk.checkpoint import load as load_checkpoint
    from paramserver.training.local_steps import LocalSteps
    from paramserver.worker.worker import ShardedWorker, Worker


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    if f"paramserver.{name}" in MOVED:  # ``ps.store`` and the like, as in the flat layout
        return importlib.import_module(MOVED[f"paramserver.{name}"])
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
    "LocalSteps",
    "OptimizerConfig",
    "OutOfOrder",
    "ParamServerError",
    "Policy",
    "RejoinRequired",
    "Security",
    "ServerApp",
    "ServerConfig",
    "ServerRewound",
    "ServerUnavailable",
    "ShardedWorker",
    "Timeout",
    "Unauthenticated",
    "UnknownWorker",
    "Worker",
    "WorkerConfig",
    "WrongIncarnation",
    "load_checkpoint",
    "model_state_dict",
    "serve",
]
