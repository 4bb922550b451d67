"""The processes of ``bench sparse``'s cases, each a run: (a), (b), (e) and (f) against a
server in this process (``ps_run``), (d) DDP (``ddp_run``) and (g) a shard's bytes per row
in a fresh process (``bytes_per_row``). ``sparse.py`` puts them side by side."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from paramserver.bench.ddp import peak_rss_mb, run_ranks
from paramserver.bench.tables.ranks import LR, Case, auc, build_model, data

WORLD = 2
RANKS = "paramserver.bench.tables.ranks"


def ps_run(
    case: Case, mode: str, steps: int, logs: Path, evaluate: bool, policy: str = "async"
) -> dict[str, Any]:
    """(a), (b), (e) or (f): a server in this process (``policy``), its table as ``mode``
    says (``build_model``), and WORLD worker processes."""
    from paramserver.api import serve

    logging.getLogger("paramserver").setLevel(logging.WARNING)  # the server's joins and leaves
    saved = logs / f"train-{case.name}.pt"  # made once here, not in each worker
    if not saved.exists():
        torch.save(data(case)[:2], saved)
    rss_before = peak_rss_mb("VmRSS")
    cpu_before = time.process_time()  # this process runs only the server meanwhile
    server = serve(
        build_model(case, mode),
        optimizer=case.optimizer,
        lr=LR,
        policy=policy,
        workers=WORLD,
        lease_seconds=120,
    )
    try:
        name = f"ps-{case.name}-{mode}-{policy}"
        results = run_ranks(
            RANKS,
            ["ps", server.address, case.name, mode, str(steps), str(saved)],
            WORLD,
            logs,
            name,
            timeout=1800,
        )
        status = server.status()
        server_cpu = time.process_time() - cpu_before
        server_growth = peak_rss_mb("VmRSS") - rss_before
        state = server.model_state_dict() if evaluate else None
    finally:
        server.stop(grace=0)
    steps_done = sum(r["steps"] for r in results)
    moved = sum(
        (r["rows_fetched"] + r["rows_pushed"]) * case.row_bytes
        + 2 * 4 * r["dense_numel"] * r["steps"]
        for r in results
    )
    out = {
        "samples_per_s": sum(r["samples"] for r in results) / max(r["seconds"] for r in results),
        "bytes_per_step": moved / steps_done,
        "rows_per_step": sum(r["rows_fetched"] + r["rows_pushed"] for r in results) / steps_done,
        "worker_rss_mb": max(r["peak_rss_mb"] for r in results),
        "rows_held": status["rows_held"],
        "evicted": sum(status["table_evicted"].values()),
        "dropped": sum(status["table_dropped"].values()),
        "server_rss_growth_mb": server_growth,
        "steps": steps_done,
        # where a step's CPU goes: the workers' (compute and their own overhead: compare
        # local's ms a step) and the server's, every thread of each process
        "cpu_ms_per_step": {
            "workers": 1e3 * sum(r["cpu_seconds"] for r in results) / steps_done,
            "server": 1e3 * server_cpu / steps_done,
        },
    }
    if state is not None:
        _, _, test_x, test_y = data(case)
        model = build_model(case, "dense")
        model.load_state_dict(state, strict=True)
        out["auc"] = auc(model, test_x, test_y)
    return out


def ddp_run(case: Case, logs: Path) -> dict[str, Any]:
    """(d), tried twice: torch's sparse all-reduce over gloo once aborted a rank here with
    glibc's "malloc(): unaligned tcache chunk detected" (heap corruption inside torch)."""
    try:
        results = run_ranks(RANKS, [case.name], WORLD, logs, f"ddp-{case.name}", timeout=1800)
    except RuntimeError as exc:
        print(f"warning: the DDP baseline failed once, running it again: {exc}", file=sys.stderr)
        results = run_ranks(RANKS, [case.name], WORLD, logs, f"ddp-{case.name}", timeout=1800)
    return {
        "samples_per_s": sum(r["samples"] for r in results) / max(r["seconds"] for r in results),
        "auc": results[0]["auc"],
    }


def bytes_per_row(rows: int) -> dict[str, Any]:
    """(g), in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-m", "paramserver.bench.tables.row_memory", str(rows)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
