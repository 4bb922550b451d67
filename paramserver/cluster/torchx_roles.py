"""Roles under torchx (``paramserver.launchers.torchx``'s component), for settings no source
gave, as ``roles.py`` reads TF_CONFIG. Torch-free and torchx-free.

The component sets ``PARAMSERVER_TORCHX`` to "RANK0_ENV SHARDS PORT" in both roles: torchx
replaces its ``${rank0_env}`` macro by the name of the variable its scheduler sets to the
host of the first role's replica 0, and the server role is the first. Shard ``i`` listens on
``PORT + 2 * i`` (its data port is the next one up), so shards that share a host do not
collide. Its host is in the same variable for replica ``i``:

- Slurm: ``SLURM_JOB_NODELIST_HET_GROUP_<i>`` (each replica is its own heterogeneous group,
  of one node);
- Kubernetes (Volcano): ``VC_SERVER_<i>_HOSTS``;
- the local schedulers: ``TORCHX_RANK0_HOST`` (localhost) for every replica.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from paramserver.errors import ConfigError

ENV = "PARAMSERVER_TORCHX"


@dataclass(frozen=True)
class Torchx:
    """What ``PARAMSERVER_TORCHX`` says."""

    rank0_env: str
    shards: int
    port: int


def from_env(environ: Mapping[str, str]) -> Torchx | None:
    """The component's setting; None when it is unset or empty.

    Raises:
        ConfigError: it is not "RANK0_ENV SHARDS PORT".
    """
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    parts = raw.split()
    if (
        len(parts) != 3
        or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", parts[0])
        or not parts[1].isdigit()
        or not parts[2].isdigit()
        or int(parts[1]) < 1
    ):
        raise ConfigError(
            f"{ENV} is 'RANK0_ENV SHARDS PORT' (the torchx component sets it); got {raw!r}."
        )
    return Torchx(parts[0], int(parts[1]), int(parts[2]))


def host_env(rank0_env: str, shard: int) -> str:
    """The variable holding shard ``shard``'s host: replica 0's name with its index
    replaced (``..._GROUP_0``, ``VC_SERVER_0_HOSTS``), or the same name where it has none
    (the local schedulers: one host)."""
    match = re.fullmatch(r"(.*_)0(_HOSTS)?", rank0_env)
    if match is None:
        return rank0_env
    return f"{match[1]}{shard}{match[2] or ''}"


def server_settings(tx: Torchx, shard: str) -> dict[str, Any]:
    """What the component implies for ``paramserver server --shard I/S``: its port, every
    interface.

    Raises:
        ConfigError: the shard is not "I/S" of the component's S.
    """
    match = re.fullmatch(r"(\d+)/(\d+)", shard.strip())
    if match is None or int(match[2]) != tx.shards or int(match[1]) >= tx.shards:
        raise ConfigError(
            f"Under {ENV} a server is --shard I/{tx.shards} (the component passes torchx's "
            f"replica id); got {shard!r}."
        )
    return {"port": tx.port + 2 * int(match[1]), "host": "0.0.0.0"}


def worker_settings(
    tx: Torchx, environ: Mapping[str, str], resolve: Callable[[str], str] = str
) -> dict[str, Any]:
    """Every shard's address, in order, for ``paramserver worker``; ``resolve`` turns a host
    the scheduler names into one to dial (``node_address`` under Slurm).

    Raises:
        ConfigError: the scheduler did not set a shard's host variable.
    """
    addresses = []
    for i in range(tx.shards):
        name = host_env(tx.rank0_env, i)
        host = environ.get(name, "").split(",")[0].strip()
        if not host:
            raise ConfigError(
                f"{ENV} names {tx.rank0_env} for the servers' hosts, but {name} (shard {i}'s) "
                "is not set: run the workers under the component's scheduler, or give --server."
            )
        if name == tx.rank0_env and i > 0 and host not in ("localhost", "127.0.0.1"):
            raise ConfigError(
                f"{tx.rank0_env} is {host!r}, one host for every shard: only a scheduler that "
                "runs every replica on this host (local_cwd) names the shards so; run more "
                "than one shard there, or give --server."
            )
        addresses.append(f"{resolve(host)}:{tx.port + 2 * i}")
    return {"server_address": ",".join(addresses)}


def node_address(name: str) -> str:
    """A Slurm node's address: its name where that resolves, else the NodeAddr ``scontrol``
    gives it (nodes whose names are not host names), else the name."""
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        pass
    if shutil.which("scontrol") is None:
        return name
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", "-o", name], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return name
    found = re.search(r"\bNodeAddr=(\S+)", out)
    return found[1] if found else name
