"""Sparse tables: the same DLRM on the same click log trained four ways, side by
side in one run, then a table too large for a worker.

(a) tables: a server (in this process) holds the table's rows; 2 worker processes pull the
    rows a batch touches and push their gradients (``ps.Worker``, async);
(b) dense: the same, the table a dense parameter (every step moves all of it); a few steps
    only, to measure its rate;
(c) local: one process, SparseAdam on the table and Adam on the rest; its AUC also with the
    table declared and trained on its own under the servers' row optimizer (lazy adam whose
    bias correction counts each row's steps: SparseAdam counts the table's);
(d) DDP: 2 processes (gloo), the table's gradients all-reduced sparse.

Each reports samples/s; (a) and (b) their payload bytes per step (ids and values of the rows
fetched and pushed, and the flat buffer's weights and gradients), (a), (c) and (d) the test
AUC after one epoch; (a) also under sync and delay-1, each policy's AUC against (c)'s and
(d)'s. Then:

(e) lifecycle: (a) with the table declared (``paramserver.sparse.Embedding``) with a
    lifecycle: ids admitted at their second push, a capacity of a sixteenth of the table's
    rows (a half in the quick run): rows live against the rows (a) touched, and its AUC
    against (a)'s;
(f) big: (a) alone on a declared table of 8 GiB (32M rows x 64), of which about 1.1 GB
    come to exist on the server: each worker's peak resident memory against the declared
    table, and how far the server's grew;
(g) bytes per row: a shard's resident memory per row held, lazy adam at dim 16, in a fresh
    process (``row_memory.py``);
(h)-(k) Criteo: a recommender DLRM on a Criteo-like stream (26 tables of the Criteo Kaggle
    cardinalities, batch 1024) sparse, its tables dense, a small dense DLRM of the same
    shape, one local process; the sparse run's export and serving (``bench/criteo/case.py``).
    ``--only criteo`` runs it alone.

The processes are in ``ranks.py``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import click
import torch

from paramserver.bench.criteo import case as criteo_case
from paramserver.bench.ddp import peak_rss_mb, run_ranks
from paramserver.bench.tables.ranks import (
    CASES,
    LR,
    Case,
    auc,
    build_model,
    data,
    local_run,
)

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


class Runs(NamedTuple):
    """What each way measured on the main case, the lifecycle run, the big case's run, and
    the bytes per row."""

    local: dict[str, Any]
    ddp: dict[str, Any]
    tables: dict[str, Any]
    dense: dict[str, Any]
    life: dict[str, Any]
    large: dict[str, Any]
    rows: dict[str, Any]


ONLY = ("", "criteo")


def run(quick: bool, only: str = "") -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Cases (a) to (g), then the Criteo case (``bench/criteo/case.py``); ``only`` "criteo": that
    case alone."""
    if only not in ONLY:
        raise click.UsageError(
            f"bench sparse --only: no case {only!r}; there is {', '.join(ONLY[1:])}."
        )
    with tempfile.TemporaryDirectory(prefix="paramserver-bench-") as tmp:
        rows, figures = ([], {}) if only else first_cases(quick, Path(tmp))
        criteo = Path(tmp) / "criteo"
        criteo.mkdir()
        more_rows, more = criteo_case.run(quick, criteo)
    return rows + more_rows, {**figures, **more, "only": only}


def first_cases(quick: bool, logs: Path) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Cases (a) to (g)."""
    main, big = (
        (CASES["quick-main"], CASES["quick-big"]) if quick else (CASES["main"], CASES["big"])
    )
    local = local_run(main)
    local["auc_rows"] = local_run(main, rows=True)["auc"]
    ddp = ddp_run(main, logs)
    tables = ps_run(main, "sparse", steps=0, logs=logs, evaluate=True)
    policies = {
        policy: ps_run(main, "sparse", steps=0, logs=logs, evaluate=True, policy=policy)
        for policy in ("sync", "delay-1")
    }
    policies["async"] = tables
    dense = ps_run(main, "dense", steps=main.dense_steps, logs=logs, evaluate=False)
    life = ps_run(main, "lifecycle", steps=0, logs=logs, evaluate=True)
    large = ps_run(big, "declared", steps=0, logs=logs, evaluate=False)
    rows = bytes_per_row(200_000 if quick else 2_000_000)
    runs = Runs(local, ddp, tables, dense, life, large, rows)
    figures = figures_of(main, big, runs)
    by_policy = per_policy(policies, local, ddp, figures)
    return rows_of(main, big, runs, figures) + by_policy, figures


def per_policy(
    policies: dict[str, dict[str, Any]],
    local: dict[str, Any],
    ddp: dict[str, Any],
    figures: dict[str, Any],
) -> list[tuple[str, str]]:
    """(a) under each policy: its AUC against one local process's and DDP's, its rate;
    and issue 44's targets beside them."""
    local_rate = figures["samples_per_s"]["local"]
    figures["auc_by_policy"] = {p: r["auc"] for p, r in policies.items()}
    figures["auc_minus_local_by_policy"] = {p: r["auc"] - local["auc"] for p, r in policies.items()}
    figures["auc_minus_ddp_by_policy"] = {p: r["auc"] - ddp["auc"] for p, r in policies.items()}
    figures["samples_per_s_by_policy"] = {p: r["samples_per_s"] for p, r in policies.items()}
    figures["auc_minus_ddp"] = figures["auc_minus_ddp_by_policy"]["async"]
    figures |= {
        "target_auc_minus_ddp": 0.002,
        "target_sparse_vs_local": 1.0,
        "target_sparse_vs_ddp": 1.5,
    }
    return [
        (
            f"(a) {policy}",
            f"{r['samples_per_s']:,.0f} samples/s ({r['samples_per_s'] / local_rate:.2f}x "
            f"local), AUC {r['auc']:.4f}: {r['auc'] - local['auc']:+.4f} against local, "
            f"{r['auc'] - ddp['auc']:+.4f} against DDP (target within 0.002 of DDP)",
        )
        for policy, r in policies.items()
    ]


def figures_of(main: Case, big: Case, runs: Runs) -> dict[str, Any]:
    """The report's figures: each way's rate and AUC, the payloads, the big table's memory."""
    local, ddp, tables, dense, life, large, rows = runs
    local_rate = local["samples"] / local["seconds"]
    big_mb = large["rows_held"] * big.dim * 4 / 2**20
    return {
        "case": main.name,
        "table_rows": main.table_rows,
        "dim": main.dim,
        "batch": main.batch,
        "samples_per_s": {
            "tables": tables["samples_per_s"],
            "dense": dense["samples_per_s"],
            "local": local_rate,
            "ddp": ddp["samples_per_s"],
        },
        "sparse_vs_dense": tables["samples_per_s"] / dense["samples_per_s"],
        "sparse_vs_ddp": tables["samples_per_s"] / ddp["samples_per_s"],
        "sparse_vs_local": tables["samples_per_s"] / local_rate,
        "auc": tables["auc"],
        "auc_local": local["auc"],
        "auc_local_rows": local["auc_rows"],
        "auc_ddp": ddp["auc"],
        "bytes_per_step_sparse": tables["bytes_per_step"],
        "bytes_per_step_dense": dense["bytes_per_step"],
        "rows_per_step": tables["rows_per_step"],
        "bytes_per_row_moved": tables["bytes_per_step"] / max(tables["rows_per_step"], 1),
        "big_case": big.name,
        "big_table_declared_mb": big.table_mb,
        "big_table_mb": big_mb,
        "big_worker_rss_mb": large["worker_rss_mb"],
        "big_rss_over_table": large["worker_rss_mb"] / big.table_mb,
        "big_rss_over_rows_held": large["worker_rss_mb"] / big_mb,
        "big_server_rss_mb": large["server_rss_growth_mb"],
        "big_samples_per_s": large["samples_per_s"],
        "big_bytes_per_step": large["bytes_per_step"],
        "big_rows_per_step": large["rows_per_step"],
        "lifecycle_rows_live": life["rows_held"],
        "lifecycle_rows_touched": tables["rows_held"],
        "lifecycle_capacity": main.lifecycle.capacity,
        "lifecycle_evicted": life["evicted"],
        "lifecycle_dropped": life["dropped"],
        "lifecycle_auc": life["auc"],
        "lifecycle_auc_delta": life["auc"] - tables["auc"],
        "lifecycle_samples_per_s": life["samples_per_s"],
        "bytes_per_row": rows["bytes_per_row"],
        "bytes_per_row_vs_state": rows["bytes_per_row"] / rows["state_bytes_per_row"],
    }


def rows_of(main: Case, big: Case, runs: Runs, figures: dict[str, Any]) -> list[tuple[str, str]]:
    """The readable table of ``figures``."""
    local, ddp, tables, dense, life, large, per_row = runs
    local_rate = figures["samples_per_s"]["local"]
    big_mb = figures["big_table_mb"]
    rate = figures["samples_per_s"]
    rows = [
        (
            "setup",
            f"DLRM, one table of {main.table_rows:,} rows x {main.dim} "
            f"({main.table_mb:.0f} MB), {main.fields} fields, batch {main.batch}, "
            f"{main.optimizer} lr {LR}, {WORLD} workers async, 1 epoch of {main.train:,}",
        ),
        (
            "(a) tables",
            f"{rate['tables']:,.0f} samples/s, {tables['bytes_per_step'] / 2**20:.2f} "
            f"MB/step ({tables['rows_per_step']:,.0f} rows), AUC {tables['auc']:.4f}",
        ),
        (
            "(b) dense",
            f"{rate['dense']:,.0f} samples/s, {dense['bytes_per_step'] / 2**20:.1f} "
            f"MB/step ({main.dense_steps} steps a worker)",
        ),
        ("(c) local", f"{local_rate:,.0f} samples/s, AUC {local['auc']:.4f}"),
        ("(d) DDP", f"{rate['ddp']:,.0f} samples/s, AUC {ddp['auc']:.4f}"),
        ("sparse_vs_dense", f"{figures['sparse_vs_dense']:.1f}x"),
        (
            "sparse_vs_ddp",
            f"{figures['sparse_vs_ddp']:.2f}x  (vs local {figures['sparse_vs_local']:.2f}x)",
        ),
        (
            "AUC tables - local",
            f"{tables['auc'] - local['auc_rows']:+.4f} against one process with the servers' "
            f"row optimizer (AUC {local['auc_rows']:.4f}); {tables['auc'] - local['auc']:+.4f} "
            "against torch's SparseAdam, which bias-corrects by the table's steps",
        ),
        (
            "(e) lifecycle",
            f"admit at the 2nd push, capacity {figures['lifecycle_capacity']:,}: "
            f"{life['rows_held']:,} rows live of {tables['rows_held']:,} touched "
            f"({life['evicted']:,} evicted, {life['dropped']:,} gradient rows dropped); "
            f"AUC {life['auc']:.4f} ({figures['lifecycle_auc_delta']:+.4f} against (a)), "
            f"{life['samples_per_s']:,.0f} samples/s",
        ),
        (
            "(f) big table",
            f"{big.table_rows:,} rows x {big.dim} declared ({big.table_mb:,.0f} MB); "
            f"{large['rows_held']:,} rows held on the server = {big_mb:,.0f} MB; the "
            f"server grew by {large['server_rss_growth_mb']:,.0f} MB",
        ),
        (
            "big: worker peak RSS",
            f"{large['worker_rss_mb']:.0f} MB = "
            f"{figures['big_rss_over_table']:.3f} of the table declared (target <= 0.1), "
            f"{figures['big_rss_over_rows_held']:.2f} of the rows held; "
            f"{large['samples_per_s']:,.0f} samples/s",
        ),
        (
            "(g) bytes per row",
            f"{per_row['bytes_per_row']:.0f} bytes of a shard's memory per row held "
            f"({per_row['rows']:,} rows, lazy adam, dim 16) = "
            f"{figures['bytes_per_row_vs_state']:.2f}x its values and state "
            f"({per_row['state_bytes_per_row']} bytes; target <= 1.3x)",
        ),
    ]
    return rows
