"""A task's role from its scheduler's environment, for settings no source gave (explicit
flags, ``PARAMSERVER_*`` variables and the config file win). Torch-free.

- ``TF_CONFIG`` (Kubeflow's TFJob, Volcano's tensorflow plugin), a JSON object::

      {"cluster": {"ps": ["ps-0:2222", "ps-1:2222"], "worker": ["w-0:2222", ...]},
       "task": {"type": "ps", "index": 1}}

  A "ps" task is server shard ``index`` of ``len(cluster.ps)``, listening on its entry's
  port on every interface, for ``len(cluster.worker)`` workers (a "chief" counts as one). A
  "worker" or "chief" task dials every ps entry, in order.
- ``--shard auto`` (a Kubernetes StatefulSet): the shard index is the pod's ordinal, the
  number after the last "-" of the host name, and the shard count is ``PARAMSERVER_SHARDS``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from paramserver.errors import ConfigError

SERVER_TYPES = ("ps",)
WORKER_TYPES = ("worker", "chief")


@dataclass(frozen=True)
class Task:
    """This process's place in a TF_CONFIG cluster."""

    type: str
    index: int
    ps: tuple[str, ...]
    workers: tuple[str, ...]


def tf_config(environ: Mapping[str, str]) -> Task | None:
    """The task ``TF_CONFIG`` describes; None when it is unset or empty.

    Raises:
        ConfigError: it is not a TF_CONFIG (the message says what is wrong).
    """
    raw = environ.get("TF_CONFIG", "").strip()
    if not raw:
        return None
    try:
        doc = json.loads(raw)
        cluster, task = doc.get("cluster", {}), doc["task"]
        ps = tuple(cluster.get("ps", ()))
        workers = tuple(cluster.get("chief", ())) + tuple(cluster.get("worker", ()))
        kind, index = str(task["type"]), int(task.get("index", 0))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(
            f"TF_CONFIG is not a TF_CONFIG ({exc!r}): expected "
            '{"cluster": {"ps": [...], "worker": [...]}, "task": {"type": ..., "index": N}}.'
        ) from None
    if not ps or not all(isinstance(a, str) and ":" in a for a in ps):
        raise ConfigError(f"TF_CONFIG's cluster.ps must list the servers' host:port; got {ps}.")
    return Task(kind, index, ps, workers)


def server_settings(task: Task) -> dict[str, Any]:
    """What a "ps" task implies for ``paramserver server`` (click parameter names).

    Raises:
        ConfigError: the task is not a ps task, or its index is out of range.
    """
    if task.type not in SERVER_TYPES:
        raise ConfigError(
            f"TF_CONFIG says this task is a {task.type!r}: run `paramserver worker` for it "
            "(`paramserver server` runs the ps tasks)."
        )
    if not 0 <= task.index < len(task.ps):
        raise ConfigError(
            f"TF_CONFIG's task.index {task.index} is not one of its {len(task.ps)} ps."
        )
    port = task.ps[task.index].rsplit(":", 1)[1]
    if not port.isdigit():
        raise ConfigError(f"TF_CONFIG's ps entry {task.ps[task.index]!r} has no port number.")
    settings: dict[str, Any] = {
        "shard": f"{task.index}/{len(task.ps)}",
        "port": int(port),
        "host": "0.0.0.0",
    }
    if task.workers:
        settings["workers"] = len(task.workers)
    return settings


def worker_settings(task: Task) -> dict[str, Any]:
    """What a "worker" or "chief" task implies for ``paramserver worker``.

    Raises:
        ConfigError: the task is a ps task.
    """
    if task.type not in WORKER_TYPES:
        raise ConfigError(
            f"TF_CONFIG says this task is a {task.type!r}: run `paramserver server` for it."
        )
    return {"server_address": ",".join(task.ps), "name": f"{task.type}-{task.index}"}


def auto_shard(hostname: str, environ: Mapping[str, str]) -> str:
    """``--shard auto``: "I/S" from the pod's ordinal and ``PARAMSERVER_SHARDS``.

    Raises:
        ConfigError: the host name ends in no ordinal, or the count is missing or too small.
    """
    match = re.search(r"-(\d+)$", hostname)
    if match is None:
        raise ConfigError(
            f"--shard auto takes the shard from the host name's ordinal (a StatefulSet pod "
            f"such as paramserver-2), but the host name is {hostname!r}."
        )
    shards = environ.get("PARAMSERVER_SHARDS", "")
    if not shards.isdigit() or int(match[1]) >= int(shards):
        raise ConfigError(
            f"--shard auto needs PARAMSERVER_SHARDS, the number of shards (the StatefulSet's "
            f"replicas), above the ordinal {match[1]}; got {shards!r}."
        )
    return f"{match[1]}/{shards}"
