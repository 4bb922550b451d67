"""The cores a server's optimizer, checks and copies run on (``--server-threads``): the
host's usable cores (its CPU affinity, capped by a cgroup v2 CPU quota) shared out among
the shards started on it. The arithmetic is pure (``usable_cores``, ``server_threads``);
``host_cores`` reads this process's affinity and quota. Torch-free."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

# cgroup v2: the root of the cgroup filesystem, and this process's own cgroup in it.
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")

log = logging.getLogger(__name__)


def quota_cores(cpu_max: str | None) -> int | None:
    """The cores a cgroup v2 ``cpu.max`` (``"QUOTA PERIOD"``, microseconds) allows,
    rounded up; None where it sets no limit (``max``), or is absent or unreadable."""
    fields = (cpu_max or "").split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def usable_cores(affinity: int, cpu_maxes: Sequence[str | None] = ()) -> tuple[int, str]:
    """The cores this process may run on: ``affinity`` (the CPUs it may be scheduled on)
    capped by the tightest of the cgroup ``cpu.max`` quotas given (its cgroup's and those
    above it); and where the number came from, in words."""
    cores = max(1, affinity)
    where = f"{cores} CPUs in its affinity"
    for text in cpu_maxes:
        cap = quota_cores(text)
        if cap is not None and cap < cores:
            cores, where = cap, f"the cgroup CPU quota ({' '.join((text or '').split())})"
    return cores, where


def server_threads(
    given: int | None, shards_on_host: int, cores: int, where: str
) -> tuple[int, str]:
    """The threads of a server given ``--server-threads`` ``given`` (None: not given), one
    of ``shards_on_host`` shards on a host of ``cores`` usable cores (found from
    ``where``): what was given, else ``cores // shards_on_host``, at least 1; and where
    the number came from, for the log."""
    if given is not None:
        return given, "--server-threads"
    shards = max(1, shards_on_host)
    threads = max(1, cores // shards)
    if shards == 1:
        return threads, f"the host's usable cores: {where}"
    return threads, f"{cores} usable cores ({where}) shared by {shards} shards on the host"


def _cgroup_dirs() -> list[Path]:
    """This process's cgroup v2 directory and those above it, up to the root."""
    dirs = [CGROUP_ROOT]
    try:
        lines = SELF_CGROUP.read_text().splitlines()
    except OSError:
        return dirs
    for line in lines:
        if line.startswith("0::/"):
            here = CGROUP_ROOT
            for part in line[4:].strip().split("/"):
                if part and part not in (".", ".."):
                    here = here / part
                    dirs.append(here)
    return dirs


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def host_cores() -> tuple[int, str]:
    """This process's usable cores (``usable_cores`` of its affinity and of the cgroup
    quotas over it), and where the number came from."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    return usable_cores(affinity, [_read(d / "cpu.max") for d in _cgroup_dirs()])


def shard_threads(given: int | None, shards: int) -> int:
    """``--server-threads`` of each of ``shards`` shards started on this host (by launch):
    ``given`` where the user gave it, else this host's usable cores shared out among them
    (said in the log)."""
    threads, where = server_threads(given, shards, *host_cores())
    if given is None:
        log.info("%d server threads a shard: %s", threads, where)
    return threads
