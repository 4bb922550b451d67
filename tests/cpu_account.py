"""Opt-in: each test's CPU, its own and its reaped children's, beside its wall time.

``PARAMSERVER_TEST_CPU=PREFIX pytest ...`` appends one tab-separated line per test to
``PREFIX.<xdist worker or "main">``: node id, wall s, CPU s of the test process, CPU s of
the child processes it started and waited for (``RUSAGE_CHILDREN``: a child's own reaped
children included; and the zygote's, with the children it forked and reaped), and when it
started (seconds since the epoch: where each process went idle at the end). The suite's time budget is
mostly CPU on a 2-core machine, and a wall-time list alone cannot say which tests burn it.
``python -m tests.cpu_account PREFIX`` prints the totals and the heaviest tests.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return (
        usage.ru_utime + usage.ru_stime + (_zygote_cpu() if who == resource.RUSAGE_CHILDREN else 0)
    )


def _zygote_cpu() -> float:
    """The CPU of this process's zygote and of the children it reaped (those children are
    not ours to reap: see paramserver.cluster.zygote)."""
    from paramserver.cluster import procs

    zygote = procs._zygote
    if zygote is None or zygote.proc is None:
        return 0.0
    try:
        fields = Path(f"/proc/{zygote.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0  # exited: reaped by us, in RUSAGE_CHILDREN from then on
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class CpuAccount:
    def __init__(self, prefix: str, worker: str) -> None:
        self.path = Path(f"{prefix}.{worker}")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        began = time.time()
        start = (time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN))
        yield
        wall = time.monotonic() - start[0]
        own = _cpu(resource.RUSAGE_SELF) - start[1]
        kids = _cpu(resource.RUSAGE_CHILDREN) - start[2]
        with self.path.open("a") as out:
            out.write(f"{item.nodeid}\t{wall:.2f}\t{own:.2f}\t{kids:.2f}\t{began:.2f}\n")


def register(config: pytest.Config) -> None:
    prefix = os.environ.get("PARAMSERVER_TEST_CPU")
    if prefix:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        config.pluginmanager.register(CpuAccount(prefix, worker), "cpu_account")


def main(prefix: str, top: int = 40) -> None:
    rows = []
    spans: dict[str, tuple[float, float]] = {}  # each process's first start, last end
    for path in Path(prefix).parent.glob(Path(prefix).name + ".*"):
        for line in path.read_text().splitlines():
            node, wall, own, kids, began = (line.split("\t") + ["0"])[:5]
            rows.append((node, float(wall), float(own), float(kids)))
            lo, hi = spans.get(path.suffix, (float(began), 0.0))
            spans[path.suffix] = (min(lo, float(began)), max(hi, float(began) + float(wall)))
    wall = sum(r[1] for r in rows)
    cpu = sum(r[2] + r[3] for r in rows)
    print(f"{len(rows)} tests: wall {wall:.0f} s, CPU {cpu:.0f} s")
    if spans and all(lo > 0 for lo, _ in spans.values()):
        first, last = min(lo for lo, _ in spans.values()), max(hi for _, hi in spans.values())
        print(f"from the first test's start to the last one's end: {last - first:.0f} s")
        for name, (_, hi) in sorted(spans.items()):
            print(f"  {name[1:]}: done {hi - first:.0f} s in, idle for the last {last - hi:.0f} s")
    by_file: dict[str, list[float]] = {}
    for node, w, own, kids in rows:
        acc = by_file.setdefault(node.split("::")[0], [0.0, 0.0])
        acc[0] += w
        acc[1] += own + kids
    print("\nby file (wall, CPU):")
    for name, (w, c) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {c:7.0f} CPU {w:7.0f} wall  {name}")
    print("\nheaviest tests (CPU = own + children, wall):")
    for node, w, own, kids in sorted(rows, key=lambda r: -(r[2] + r[3]))[:top]:
        print(f"  {own + kids:7.1f} CPU ({own:6.1f} + {kids:6.1f}) {w:7.1f} wall  {node}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
