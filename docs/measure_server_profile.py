"""Where a server's CPU goes on ``bench sparse``'s (a) run (issue 44): the 1M-row DLRM, 2
async workers (their own processes) against a server in this process, twice. First plain:
the server's CPU a worker step (``time.process_time`` of this process, whose main thread
only waits). Then under yappi's CPU clock, every server thread: the CPU of each part of a
step's two requests (the push-pull on the control socket, the row pull over gRPC), as
shares of the profiled total, applied to the plain run's figure (the profiler slows Python
more than native code, so the shares lean towards Python).

Run: .venv/bin/pip install yappi && .venv/bin/python docs/measure_server_profile.py
(yappi, a multi-thread CPU profiler, is not a dependency of paramserver: only this script
needs it.)
"""

import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from paramserver.api import serve
from paramserver.bench.tables.ranks import CASES, LR, build_model, data

# (label, yappi's name of the function whose inclusive CPU it is), indented: a part of
# the row above
PARTS = [
    ("push-pull on the control socket, in all", "Doorbell._answer"),
    ("  the push (Steps.push)", "Steps.push"),
    ("    the coordinator's push", "Coordinator.push"),
    ("      check (ids, finite, rows' initial values)", "check_push"),
    ("      the rows' apply (TableSet.apply)", "TableSet.apply"),
    ("        the rows' optimizer", "RowOptimizer.step"),
    ("        new rows made", "ShardTable._create"),
    ("      the dense apply (Applies.apply)", "Applies.apply"),
    ("  the pull of the weights (Steps.pull)", "Steps.pull"),
    ("row pull over gRPC, in all (_unary_response_in_pool)", "_unary_response_in_pool"),
    ("  the coordinator's row pull", "Coordinator.pull_rows"),
    ("    initial values of rows not held", "initial_values_many"),
    ("gRPC's own polling thread (_serve)", "_serve"),
]

case = CASES["main"]
logging.getLogger("paramserver").setLevel(logging.WARNING)


def run(d: Path, saved: Path, profile: Path | None = None) -> tuple[int, float]:
    """The workers' steps, and this process's CPU seconds while they ran; with
    ``profile``, rank 0 runs under cProfile, which writes there."""
    server = serve(
        build_model(case, "sparse"),
        optimizer=case.optimizer,
        lr=LR,
        policy="async",
        workers=2,
        lease_seconds=120,
    )
    try:
        cpu = time.process_time()
        procs = []
        for rank in range(2):
            pre = ["-m", "cProfile", "-o", str(profile)] if profile and rank == 0 else []
            argv = [str(rank), "2", "0", "ps", server.address, case.name, "sparse", "0"]
            argv += [str(saved), str(d / f"out{rank}.json")]
            procs.append(
                subprocess.Popen(
                    [sys.executable, *pre, "-m", "paramserver.bench.tables.ranks", *argv]
                )
            )
        for p in procs:
            p.wait(timeout=600)
        cpu = time.process_time() - cpu
        steps = sum(json.loads((d / f"out{r}.json").read_text())["steps"] for r in range(2))
        return steps, cpu
    finally:
        server.stop(grace=0)


def main() -> None:
    import yappi

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        saved = d / "train.pt"
        torch.save(data(case)[:2], saved)
        run(d, saved)  # imports and first touches out of the way
        steps, cpu = run(d, saved)
        plain = 1e3 * cpu / steps
        print(f"plain: {steps} worker steps, server CPU {plain:.2f} ms a step")
        yappi.set_clock_type("cpu")
        yappi.start(builtins=True)
        steps, _ = run(d, saved)
        yappi.stop()
    threads = {t.id: t for t in yappi.get_thread_stats()}
    total = sum(t.ttot for t in threads.values() if t.name != "_MainThread")
    stats = {}
    for f in yappi.get_func_stats():
        stats[f.name] = max(stats.get(f.name, 0.0), f.ttot)
    print(
        f"profiled: {steps} worker steps, server threads' CPU {1e3 * total / steps:.2f} ms a step"
    )
    print(f"{'':56} {'share':>6} {'ms a step':>9}")
    for label, name in PARTS:
        share = stats.get(name, 0.0) / total
        print(f"{label:56} {100 * share:5.1f}% {plain * share:9.2f}")


if __name__ == "__main__":
    main()
