"""What every benchmark shares: timing, a server in a child process, the report."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from paramserver.procs import Child

READY_MARKER = "paramserver server listening on"


def median_seconds(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    """The median wall time of ``fn()`` over ``reps`` runs, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@contextmanager
def server_process(*args: str, timeout: float = 120.0) -> Iterator[str]:
    """A ``paramserver server`` child on a free loopback port; yields its address."""
    with tempfile.TemporaryDirectory(prefix="paramserver-bench-") as tmp:
        child = Child(
            "bench-server",
            ["server", "--host", "127.0.0.1", "--port", "0", *args],
            Path(tmp) / "server.log",
            capture_stdout=True,
        )
        try:
            line = child.wait_for_line(READY_MARKER, timeout)
            yield line.rsplit(" ", 1)[-1]
        finally:
            child.stop()


def report(name: str, rows: list[tuple[str, str]], figures: dict[str, Any], as_json: bool) -> None:
    """A readable table, or with ``--json`` one JSON line of the figures."""
    if as_json:
        click.echo(json.dumps({"bench": name, **figures}, sort_keys=True))
        return
    width = max(len(k) for k, _ in rows)
    click.echo(f"paramserver bench {name}")
    for key, value in rows:
        click.echo(f"  {key:<{width}}  {value}")
