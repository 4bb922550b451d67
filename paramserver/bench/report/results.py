"""``docs/RESULTS.md`` from the runs' JSON (``make results``): each run of the main job (and,
with ``--resnet``, of the ResNet) is measured with ``paramserver launch --json`` and kept as
one JSON record in ``docs/results/`` with its command, date and machine; the page is then
written from those records alone, so its figures are never typed by hand. README's results
block is written too, from the same records and the benchmarks' latest dated lines
(``paramserver.bench.report.readme``), and so are docs/BENCHMARKS.md's tables
(``paramserver.bench.report.benchmarks``).

    python -m paramserver.bench.report.results            # measure every run, then write the pages
    python -m paramserver.bench.report.results --render   # write the pages from the records kept
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from paramserver.bench.report import benchmarks, readme

POLICIES = ("sync", "delay-1", "ssp:3", "async")


@dataclass(frozen=True)
class Run:
    """One measured run: its record's name, its section, its ``launch`` arguments."""

    name: str
    section: str
    args: tuple[str, ...]


MAIN_ARGS = ("--workers", "2", "--model", "mlp", "--epochs", "8")
RESNET_ARGS = ("--workers", "2", "--model", "resnet")


def runs(resnet: bool) -> list[Run]:
    found = [Run(f"main-{_file(p)}", "main", (*MAIN_ARGS, "--policy", p)) for p in POLICIES]
    if resnet:
        found += [
            Run(f"resnet-{_file(p)}", "resnet", (*RESNET_ARGS, "--policy", p)) for p in POLICIES
        ]
    return found


def _file(policy: str) -> str:
    return policy.replace(":", "")  # ssp:3 -> ssp3: no colon in a file name


def policy_of(record: dict[str, Any]) -> str:
    """The policy as the command named it (the server reports delay-1 as ssp:1)."""
    words = record["command"].split()
    return (
        words[words.index("--policy") + 1] if "--policy" in words else record["summary"]["policy"]
    )


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            ln.split(":", 1)[1].strip()
            for ln in cpuinfo.read_text().splitlines()
            if ln.startswith("model name")
        ]
        cpu = names[0] if names else ""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": round(memory),
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def commit() -> str | None:
    """The commit of the tree the figures were measured from (short; "+changes" where the
    tracked files differ from it), or None outside a git checkout."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=here, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no")
    return f"{head}+changes" if changed else head


def epoch_accuracies(run_dir: str) -> list[float]:
    """The test accuracy after each epoch, from the run folder's ``metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [m["test_accuracy"] for m in lines if "epoch" in m and "test_accuracy" in m]


def measure(run: Run, out: Path) -> dict[str, Any]:
    """Runs ``paramserver launch ARGS --json`` and keeps its record in ``out``."""
    command = [sys.executable, "-m", "paramserver", "launch", *run.args, "--json"]
    click.echo(f"measuring {run.name}: paramserver launch {' '.join(run.args)} --json", err=True)
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    record = {
        "name": run.name,
        "section": run.section,
        "command": f"paramserver launch {' '.join(run.args)} --json",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "summary": summary,
        "epochs": epoch_accuracies(summary.get("run_dir", "")),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{run.name}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def _row(record: dict[str, Any]) -> str:
    s = record["summary"]
    return (
        f"| {policy_of(record)} | {100 * s['test_accuracy']:.2f}% | {s['samples_per_s']:,.0f} | "
        f"{s['train_s']:.1f} | {s['wall_s']:.1f} | {s['max_staleness']} | {s['version']:,} |"
    )


def _section(title: str, intro: str, records: list[dict[str, Any]]) -> list[str]:
    if not records:
        return []
    lines = [f"## {title}", "", intro, "", "```"]
    lines += [r["command"] for r in records]
    lines += ["```", "", f"Measured {records[0]['date']}, one run per policy, back to back:", ""]
    lines += [
        "| policy | test accuracy | samples/s | train s | wall s | max staleness | optimizer steps |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [_row(r) for r in records]
    lines += ["", "Test accuracy after each epoch (%):", ""]
    for r in records:
        accuracies = ", ".join(f"{100 * a:.2f}" for a in r["epochs"]) or "not recorded"
        lines.append(f"- {policy_of(r)}: {accuracies}")
    return [*lines, ""]


def render(records: list[dict[str, Any]]) -> str:
    """The page, from the records alone."""
    if not records:
        raise click.ClickException("No records in docs/results/: run without --render first.")
    main = [r for r in records if r["section"] == "main"]
    resnet = [r for r in records if r["section"] == "resnet"]
    dates = sorted({r["date"][:10] for r in records})
    lines = [
        "# Results",
        "",
        "Written by `make results` (`python -m paramserver.bench.report.results`) from the JSON records",
        "in `docs/results/`; do not edit by hand. Measured on "
        f"{', '.join(dates)}: {readme.machine_text(records[0]['machine'])}. One run per row.",
        "",
        "Accuracy is on the 10,000-image Fashion-MNIST test set; `samples/s` is samples pushed",
        "divided by the time from the first accepted push to the last; `wall` includes process",
        "start-up and evaluation. The benchmarks (`paramserver bench`, ratios measured side by",
        "side) are in [BENCHMARKS.md](BENCHMARKS.md).",
        "",
    ]
    lines += _section(
        "The main job, per policy",
        "2 workers, MLP 784-256-128-10, server-side Adam lr 1e-3 with cosine decay over the run\n"
        "(launch's default), batch 64 per worker, 8 epochs, one torch thread per process. `make\n"
        "run` is the delay-1 command.",
        main,
    )
    lines += _section(
        "The ResNet, per policy",
        "2 workers, the built-in `resnet` (a 3x3 stem and three basic blocks of 16, 32 and 64\n"
        "channels with BatchNorm, whose statistics the server averages), with the model's own\n"
        "defaults: batch 64 per worker, Adam lr 0.002 with cosine decay over 10 epochs.",
        resnet,
    )
    for soak in [r for r in records if r["section"] == "chaos"]:
        lines += _chaos(soak)
    return "\n".join(lines).rstrip() + "\n"


def _chaos(r: dict[str, Any]) -> list[str]:
    """A ``paramserver chaos`` report (its ``--json`` line, with ``command`` and ``date``)."""
    recoveries: dict[str, list[float]] = {}
    for f in r["faults"]:
        recoveries.setdefault(f["fault"].split(" ")[0], []).append(f["seconds"])
    lines = [
        f"## Faults together: {r['name']}",
        "",
        f"Measured {r['date'][:16].replace('T', ' ')} UTC, one run (then the same run "
        "uninterrupted):",
        "",
        "```",
        r["command"],
        "```",
        "",
        f"{len(r['faults'])} faults over {r['config']['batches']} batches "
        f"({r['config']['epochs']} epochs, policy {r['config']['policy']}); the run took "
        f"{r['seconds']} s, uninterrupted {r['seconds_uninterrupted']} s; "
        f"{r['checkpoint_reads']} checkpoint reads meanwhile.",
        "",
        "| fault | count | recovery s (mean) | recovery s (max) |",
        "| --- | --- | --- | --- |",
    ]
    for kind, times in sorted(recoveries.items()):
        mean = sum(times) / len(times)
        lines.append(f"| {kind} | {len(times)} | {mean:.1f} | {max(times):.1f} |")
    lines += ["", "| check | held |", "| --- | --- |"]
    lines += [f"| {name} | {'yes' if held else '**no**'} |" for name, held in r["checks"].items()]
    lines += [
        "",
        f"Test accuracy {r['accuracy']:.4f} against {r['accuracy_uninterrupted']:.4f} "
        f"uninterrupted; largest difference of a weight, float buffer or table row "
        f"{r['largest_weight_difference']:.3g}; final shard statuses {r['statuses']}.",
        "",
    ]
    if r.get("notes"):
        lines += [r["notes"], ""]
    return lines


def load(folder: Path) -> list[dict[str, Any]]:
    order = {r.name: i for i, r in enumerate(runs(resnet=True))}
    records = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    return sorted(records, key=lambda r: (order.get(r["name"], len(order)), r["name"]))


@click.command()
@click.option(
    "--render",
    "render_only",
    is_flag=True,
    help="Write RESULTS.md and README's block from the records kept.",
)
@click.option("--resnet", is_flag=True, help="Also measure the ResNet per policy (about 30 min).")
@click.option("--records", default="docs/results", show_default=True, help="The records' folder.")
@click.option("--out", default="docs/RESULTS.md", show_default=True, help="The page to write.")
@click.option(
    "--readme",
    "readme_path",
    default="README.md",
    show_default=True,
    help="The README whose results block to rewrite.",
)
@click.option(
    "--bench", default="docs/bench", show_default=True, help="The benchmarks' JSON lines."
)
@click.option(
    "--benchmarks",
    "benchmarks_path",
    default="docs/BENCHMARKS.md",
    show_default=True,
    help="The page whose benchmarks' blocks to rewrite.",
)
def main(
    render_only: bool,
    resnet: bool,
    records: str,
    out: str,
    readme_path: str,
    bench: str,
    benchmarks_path: str,
) -> None:
    """Measure the runs RESULTS.md reports, then write it, README's block and the benchmarks'
    blocks of BENCHMARKS.md from the records."""
    folder = Path(records)
    if not render_only:
        for run in runs(resnet):
            measure(run, folder)
    kept = load(folder)
    page, front, bench_page = Path(out), Path(readme_path), Path(benchmarks_path)
    lines = readme.load_bench(Path(bench))
    text = readme.render(front.read_text(), kept, lines)
    bench_text = benchmarks.render(bench_page.read_text(), lines)
    page.write_text(render(kept))
    front.write_text(text)
    bench_page.write_text(bench_text)
    click.echo(f"wrote {out}, the results block of {readme_path} and {benchmarks_path}", err=True)


if __name__ == "__main__":
    main()
