"""Sparse tables: the same DLRM on the same click log trained four ways, side by
side in one run, then a table too large for a worker.

(a) tables: a server (in this process) holds the table's rows; 2 worker processes pull the
    rows a batch touches and push their gradients (``ps.Worker``, async);
(b) dense: the same, the table a dense parameter (every step moves all of it); a few steps
    only, to measure its rate;
(c) local: one process, SparseAdam on the table and Adam on the rest; its AUC also with the
    table declared and trained on its own under the servers' row optimizer (sparse-adam:
    SparseAdam's update, from the declared table's initial rows);
(d) DDP: 2 processes (gloo), the table's gradients all-reduced sparse.

Each reports samples/s; (a) and (b) their payload bytes per step (ids and values of the rows
fetched and pushed, and the flat buffer's weights and gradients), (a), (c) and (d) the test
AUC after one epoch; (a) also under sync and delay-1, each policy's AUC against (c)'s and
(d)'s, and where a step's CPU goes (the workers', the server's, against a local step's).
Then:

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

The processes are in ``ranks.py``, each run in ``runs.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import click

from paramserver.bench.criteo import case as criteo_case
from paramserver.bench.tables.ranks import CASES, LR, Case, local_run
from paramserver.bench.tables.runs import WORLD, bytes_per_row, ddp_run, ps_run


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


ONLY = ("", "criteo", "main")


def run(quick: bool, only: str = "") -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Cases (a) to (g), then the Criteo case (``bench/criteo/case.py``); ``only`` "criteo": that
    case alone; "main": (a) under each policy, (c) and (d) alone."""
    if only not in ONLY:
        raise click.UsageError(
            f"bench sparse --only: no case {only!r}; there is {', '.join(ONLY[1:])}."
        )
    with tempfile.TemporaryDirectory(prefix="paramserver-bench-") as tmp:
        if only == "main":
            rows, figures = main_cases(quick, Path(tmp))
            return rows, {**figures, "only": only}
        rows, figures = ([], {}) if only else first_cases(quick, Path(tmp))
        criteo = Path(tmp) / "criteo"
        criteo.mkdir()
        more_rows, more = criteo_case.run(quick, criteo)
    return rows + more_rows, {**figures, **more, "only": only}


def main_cases(quick: bool, logs: Path) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """(a) under async, sync and delay-1, (c) and (d): the rates, AUCs and CPU of issue
    44's DLRM targets."""
    main = CASES["quick-main"] if quick else CASES["main"]
    local, ddp, policies = _against_baselines(main, logs)
    tables = policies["async"]
    figures = main_figures(main, local, ddp, tables)
    rows = [_setup_row(main), *main_rows(local, ddp, tables, figures)]
    return rows + per_policy(policies, local, ddp, figures), figures


def _against_baselines(
    main: Case, logs: Path
) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    """(c) with its AUC under the servers' row optimizer too, (d), and (a) under each
    policy (async first)."""
    local = local_run(main)
    local["auc_rows"] = local_run(main, rows=True)["auc"]
    ddp = ddp_run(main, logs)
    policies = {
        policy: ps_run(main, "sparse", steps=0, logs=logs, evaluate=True, policy=policy)
        for policy in ("async", "sync", "delay-1")
    }
    return local, ddp, policies


def first_cases(quick: bool, logs: Path) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Cases (a) to (g)."""
    main, big = (
        (CASES["quick-main"], CASES["quick-big"]) if quick else (CASES["main"], CASES["big"])
    )
    local, ddp, policies = _against_baselines(main, logs)
    tables = policies["async"]
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


def main_figures(
    main: Case, local: dict[str, Any], ddp: dict[str, Any], tables: dict[str, Any]
) -> dict[str, Any]:
    """(a) async against (c) and (d): rates, AUCs, a step's CPU and payload."""
    local_rate = local["samples"] / local["seconds"]
    return {
        "case": main.name,
        "table_rows": main.table_rows,
        "dim": main.dim,
        "batch": main.batch,
        "samples_per_s": {
            "tables": tables["samples_per_s"],
            "local": local_rate,
            "ddp": ddp["samples_per_s"],
        },
        "sparse_vs_ddp": tables["samples_per_s"] / ddp["samples_per_s"],
        "sparse_vs_local": tables["samples_per_s"] / local_rate,
        # a step's CPU: the workers', the server's, and one local step's (one thread)
        "cpu_ms_per_step": {
            **tables["cpu_ms_per_step"],
            "local": 1e3 * local["seconds"] * main.batch / local["samples"],
        },
        "auc": tables["auc"],
        "auc_local": local["auc"],
        "auc_local_rows": local["auc_rows"],
        "auc_ddp": ddp["auc"],
        "bytes_per_step_sparse": tables["bytes_per_step"],
        "rows_per_step": tables["rows_per_step"],
        "bytes_per_row_moved": tables["bytes_per_step"] / max(tables["rows_per_step"], 1),
    }


def figures_of(main: Case, big: Case, runs: Runs) -> dict[str, Any]:
    """The report's figures: each way's rate and AUC, the payloads, the big table's memory."""
    local, ddp, tables, dense, life, large, rows = runs
    figures = main_figures(main, local, ddp, tables)
    figures["samples_per_s"]["dense"] = dense["samples_per_s"]
    big_mb = large["rows_held"] * big.dim * 4 / 2**20
    return {
        **figures,
        "sparse_vs_dense": tables["samples_per_s"] / dense["samples_per_s"],
        "bytes_per_step_dense": dense["bytes_per_step"],
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


def _setup_row(main: Case) -> tuple[str, str]:
    return (
        "setup",
        f"DLRM, one table of {main.table_rows:,} rows x {main.dim} "
        f"({main.table_mb:.0f} MB), {main.fields} fields, batch {main.batch}, "
        f"{main.optimizer} lr {LR}, {WORLD} workers async, 1 epoch of {main.train:,}",
    )


def main_rows(
    local: dict[str, Any], ddp: dict[str, Any], tables: dict[str, Any], figures: dict[str, Any]
) -> list[tuple[str, str]]:
    """The readable lines of ``main_figures``."""
    rate = figures["samples_per_s"]
    return [
        (
            "(a) tables",
            f"{rate['tables']:,.0f} samples/s, {tables['bytes_per_step'] / 2**20:.2f} "
            f"MB/step ({tables['rows_per_step']:,.0f} rows), AUC {tables['auc']:.4f}",
        ),
        ("(c) local", f"{rate['local']:,.0f} samples/s, AUC {local['auc']:.4f}"),
        ("(d) DDP", f"{rate['ddp']:,.0f} samples/s, AUC {ddp['auc']:.4f}"),
        (
            "sparse_vs_ddp",
            f"{figures['sparse_vs_ddp']:.2f}x  (vs local {figures['sparse_vs_local']:.2f}x)",
        ),
        (
            "AUC tables - local",
            f"{tables['auc'] - local['auc_rows']:+.4f} against one process with the servers' "
            f"row optimizer (AUC {local['auc_rows']:.4f}); {tables['auc'] - local['auc']:+.4f} "
            "against torch's SparseAdam on an nn.Embedding",
        ),
        (
            "(a) CPU a step",
            "ms: workers {workers:.1f}, server {server:.1f}; one local step {local:.1f} "
            "(1.0x local on 2 cores needs their sum within 2x local's)".format(
                **figures["cpu_ms_per_step"]
            ),
        ),
    ]


def rows_of(main: Case, big: Case, runs: Runs, figures: dict[str, Any]) -> list[tuple[str, str]]:
    """The readable table of ``figures``."""
    local, ddp, tables, dense, life, large, per_row = runs
    big_mb = figures["big_table_mb"]
    rows = [
        _setup_row(main),
        *main_rows(local, ddp, tables, figures),
        (
            "(b) dense",
            f"{figures['samples_per_s']['dense']:,.0f} samples/s, "
            f"{dense['bytes_per_step'] / 2**20:.1f} MB/step ({main.dense_steps} steps a worker)",
        ),
        ("sparse_vs_dense", f"{figures['sparse_vs_dense']:.1f}x"),
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
