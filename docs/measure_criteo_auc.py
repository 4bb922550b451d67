"""Where the Criteo case's AUC goes with 2 async workers (issue 44): the runs of
``paramserver.bench.criteo.probe`` that separate the dense part's staleness, the rows'
staleness, the policy and the batch, each against one local process of the same data,
batch and optimizers. A tenth of the cardinalities and 300,000 samples by default (the
same gap as the full case, a minute or so a run on 2 cores). Each run prints one JSON line
as it ends (to --out as well); then the table BENCHMARKS.md quotes.

Run: .venv/bin/python docs/measure_criteo_auc.py [--divisor 10 --train 300000 --test 100000]
     [--only "NAME;NAME"] [--out /tmp/criteo-auc.jsonl]
The full case: --divisor 1 --train 1000000. A probe's cluster runs name their server's
--delay-compensation (``dc``, 0 unless a run sets it), not the server's default for tables.
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from paramserver.bench.criteo.probe import Probe, cluster, local

# name: (how, policy or stale part, workers, changes to the probe)
RUNS: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "local": ("local", "", 1, {}),
    "local, dense 1 step stale": ("local", "dense", 1, {}),
    "local, rows 1 step stale": ("local", "rows", 1, {}),
    "local, both 1 step stale": ("local", "both", 1, {}),
    "1 worker async": ("cluster", "async", 1, {}),
    "2 workers async": ("cluster", "async", 2, {}),
    "2 workers delay-1": ("cluster", "delay-1", 2, {}),
    "2 workers sync": ("cluster", "sync", 2, {}),
    "local b2048": ("local", "", 1, {"batch": 2048}),
    "1 worker b2048": ("cluster", "async", 1, {"batch": 2048}),
    "local rowwise-adagrad": ("local", "", 1, {"rows": "rowwise-adagrad"}),
    "local rowwise-adagrad, both stale": ("local", "both", 1, {"rows": "rowwise-adagrad"}),
    "2 workers async rowwise-adagrad": ("cluster", "async", 2, {"rows": "rowwise-adagrad"}),
    "local dense lr/2": ("local", "", 1, {"lr": 0.005}),
    "local dense lr/2, both stale": ("local", "both", 1, {"lr": 0.005}),
    "2 workers async dense lr/2": ("cluster", "async", 2, {"lr": 0.005}),
    "2 workers async (again)": ("cluster", "async", 2, {}),
    # which of the dense part: the top MLP's or the bottom MLP's staleness
    "local, top MLP 1 step stale": ("local", "dense:top.", 1, {}),
    "local, bottom MLP 1 step stale": ("local", "dense:bottom.", 1, {}),
    # is the harm done early? the dense part stale only from batch 30 (of 292), or 146
    "local, dense stale from batch 30": ("local", "dense@30", 1, {}),
    "local, dense stale from batch 146": ("local", "dense@146", 1, {}),
    # row-wise adagrad at a rate it learns at (0.01 is too slow for it)
    "local rowwise-adagrad 0.1": ("local", "", 1, {"rows": "rowwise-adagrad", "rows_lr": 0.1}),
    "local rowwise-adagrad 0.1, both stale": (
        "local",
        "both",
        1,
        {"rows": "rowwise-adagrad", "rows_lr": 0.1},
    ),
    # Persia's split: the dense part sync over 2 workers, their rows async
    "local, dense sync + rows async (2 workers)": ("local", "dense-sync", 1, {}),
    "local rowwise-adagrad 0.1, dense sync + rows async": (
        "local",
        "dense-sync",
        1,
        {"rows": "rowwise-adagrad", "rows_lr": 0.1},
    ),
    # the dense part's initial weights: how far a local process moves by its seed alone
    "local seed 1": ("local", "", 1, {"seed": 1}),
    "local seed 1, dense 1 step stale": ("local", "dense", 1, {"seed": 1}),
    "local seed 2": ("local", "", 1, {"seed": 2}),
    "local seed 2, dense 1 step stale": ("local", "dense", 1, {"seed": 2}),
    "local seed 3": ("local", "", 1, {"seed": 3}),
    "local seed 3, dense 1 step stale": ("local", "dense", 1, {"seed": 3}),
    "local seed 1, dense sync + rows async": ("local", "dense-sync", 1, {"seed": 1}),
    # sync's fewer steps: twice the rates at twice the batch
    "local b2048 lr x2": ("local", "", 1, {"batch": 2048, "lr": 0.02, "rows_lr": 0.02}),
    "2 workers sync lr x2": ("cluster", "sync", 2, {"lr": 0.02, "rows_lr": 0.02}),
    # asynchrony as momentum (Mitliagkas et al. 2016): less of Adam's own for the dense part
    "local beta1 0.5": ("local", "", 1, {"beta1": 0.5}),
    "local beta1 0.5, dense 1 step stale": ("local", "dense", 1, {"beta1": 0.5}),
    "local beta1 0": ("local", "", 1, {"beta1": 0.0}),
    "local beta1 0, dense 1 step stale": ("local", "dense", 1, {"beta1": 0.0}),
    # DC-ASGD's delay compensation of the stale dense gradient (--delay-compensation C)
    "local, dense 1 step stale, C 0.1": ("local", "dense", 1, {"dc": 0.1}),
    "local, dense 1 step stale, C 1": ("local", "dense", 1, {"dc": 1.0}),
    "local, dense 1 step stale, C 3": ("local", "dense", 1, {"dc": 3.0}),
    "local, dense 1 step stale, C 10": ("local", "dense", 1, {"dc": 10.0}),
    "local seed 1, dense 1 step stale, C 1": ("local", "dense", 1, {"seed": 1, "dc": 1.0}),
    "local, top MLP 1 step stale, C 1": ("local", "dense:top.", 1, {"dc": 1.0}),
    "2 workers async, C 1": ("cluster", "async", 2, {"dc": 1.0}),
    "2 workers async, C 3": ("cluster", "async", 2, {"dc": 3.0}),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--divisor", type=int, default=10)
    parser.add_argument("--train", type=int, default=300_000)
    parser.add_argument("--test", type=int, default=100_000)
    parser.add_argument("--only", default="", help="names of RUNS, separated by ;")
    parser.add_argument("--out", default="/tmp/criteo-auc.jsonl")
    parser.add_argument("--logs", default="/tmp/criteo-auc-logs")
    args = parser.parse_args()
    base = Probe(args.divisor, args.train, args.test)
    names = [n.strip() for n in args.only.split(";") if n.strip()] or list(RUNS)
    references: dict[Probe, float] = {}
    rows = []
    for name in names:
        how, what, world, changes = RUNS[name]
        p = dataclasses.replace(base, **changes)
        started = time.perf_counter()
        if how == "local":
            got = local(p, what)
            got["samples_per_s"] = got["samples"] / got["seconds"]
        else:
            got = cluster(p, what, world, Path(args.logs))
        got["wall_seconds"] = time.perf_counter() - started
        if p not in references:  # the local process of the same data, batch and optimizers
            references[p] = got["auc"] if (how, what) == ("local", "") else local(p)["auc"]
        got.update(name=name, probe=dataclasses.asdict(p), auc_local=references[p])
        got["delta"] = got["auc"] - references[p]
        rows.append(got)
        line = json.dumps(got)
        print(line, flush=True)
        with open(args.out, "a") as f:
            f.write(line + "\n")
    print("\n| run | AUC | local AUC | delta | samples/s | wall s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['auc']:.4f} | {r['auc_local']:.4f} | {r['delta']:+.4f} "
            f"| {r['samples_per_s']:,.0f} | {r['wall_seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
