"""Frozen, validated settings; each field the command line sets declares its flag, variable
and help (``settings.setting``). Every field is checked in ``__post_init__``; a bad value
raises ConfigError with a sentence that names the setting (its flag) and the value.

- ``base``: the choices and limits, ``Security``, the ``--shard`` and ``--checkpoint-every``
  parsers;
- ``optimizer``: ``OptimizerConfig``, the server's optimizer (built in, or a user's factory)
  and its schedule;
- ``server``: ``ServerConfig``;
- ``worker``: ``WorkerConfig`` and ``LaunchConfig`` (a server's and its workers');
- ``cores``: the host's usable cores (affinity, cgroup quota) and a shard's share of them
  (``--server-threads``' default).

May import: ``settings``, ``codec``, ``policy``, ``errors``.
"""

from paramserver.config.base import (
    AMP_MODES,
    DATASETS,
    DEFAULT_CACHE_ROWS,
    LR_SCHEDULES,
    MAX_MESSAGE_BYTES,
    MAX_PUSH_EVERY,
    MODEL_DEFAULTS,
    OPTIMIZERS,
    ROW_OPTIMIZERS,
    SHM_CHOICES,
    WIRE_CHOICES,
    Security,
    parse_every,
    parse_shard,
    parse_table_optimizers,
)
from paramserver.config.optimizer import OptimizerConfig
from paramserver.config.server import ServerConfig
from paramserver.config.worker import LaunchConfig, WorkerConfig

__all__ = [
    "AMP_MODES",
    "DATASETS",
    "DEFAULT_CACHE_ROWS",
    "LR_SCHEDULES",
    "MAX_MESSAGE_BYTES",
    "MAX_PUSH_EVERY",
    "MODEL_DEFAULTS",
    "OPTIMIZERS",
    "ROW_OPTIMIZERS",
    "SHM_CHOICES",
    "WIRE_CHOICES",
    "LaunchConfig",
    "OptimizerConfig",
    "Security",
    "ServerConfig",
    "WorkerConfig",
    "parse_every",
    "parse_shard",
    "parse_table_optimizers",
]
