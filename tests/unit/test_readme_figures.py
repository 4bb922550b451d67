"""README's figures are generated: its results block is what the kept records render, and
outside it README quotes no measured figure. Nothing is measured here."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import click
import pytest

from paramserver.bench.report import readme
from tests.unit.test_results import MACHINE, results

ROOT = Path(__file__).resolve().parents[2]

# A measured figure: a number (or a range) with the unit of a rate, a ratio, a share or a
# time, or a fraction "of" something ("0.94 of its rate"). Conditions and sizes ("64 MiB",
# "2 workers", "batch 256") are not figures. No exceptions: a target is named, not quoted.
NUMBER = r"\d[\d,.]*(?:\s*[–-]\s*\d[\d,.]*)?"
UNIT = r"(?:samples/s|[GM]B/s|[GM]bit/s|%|×|x\b|ms\b|s\b)"
FRACTION = r"\b0\.\d+(?:\s*[–-]\s*\d[\d.]*)?\s+(?:\(\w+\)\s+)?of\b"
FIGURE = re.compile(rf"{NUMBER}\s*{UNIT}|{FRACTION}")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def figures_outside(text: str) -> list[str]:
    """The figures README quotes outside its generated block and its fenced code."""
    before, _, after = readme.split(text)
    return FIGURE.findall(FENCE.sub("", before + after))


def test_the_readme_block_is_what_the_kept_records_render() -> None:
    """A hand edit of the block, or a record or bench line added without --render, fails."""
    text = (ROOT / "README.md").read_text()
    records = results.load(ROOT / "docs" / "results")
    bench = readme.load_bench(ROOT / "docs" / "bench")
    assert readme.split(text)[1] == readme.block(records, bench), (
        "README's results block is stale: python -m paramserver.bench.report.results --render"
    )


def test_the_readme_quotes_no_figure_outside_its_block() -> None:
    assert figures_outside((ROOT / "README.md").read_text()) == []


@pytest.mark.parametrize(
    "typed",
    [
        "13,150 samples/s",
        "wall 49.3 s",
        "1.7–2.0× raw TCP",
        "1.5-1.8 x DDP",
        "moves 2.5 GB/s",
        "89.1–89.4% test accuracy",
        "a 1 Gbit/s link at 0.94 of its rate",
        "at 0.5 (SGD) and 0.8 (Adam) of what its memory allows",
        "`ssp:1: test accuracy 89.15%, 42494 samples/s`",
    ],
)
def test_a_typed_figure_outside_the_block_is_found(typed: str) -> None:
    text = f"# x\n\n{readme.BEGIN}\n{readme.END}\n\nIt reaches {typed} here.\n"
    assert figures_outside(text), typed


def test_commands_sizes_and_code_are_not_figures() -> None:
    text = (
        f"{readme.BEGIN}\n{readme.END}\n"
        "a 3x3 stem, 64 MiB, 2 workers, Python ≥ 3.10, port 50052, `--epochs 3`, t−1\n"
        "```\nmake run  # 1.5 × faster, 9 s\n```\n"
    )
    assert figures_outside(text) == []


def _record(policy: str, accuracy: float) -> dict:
    return {
        "name": f"main-{policy}",
        "section": "main",
        "command": f"paramserver launch --workers 2 --policy {policy} --json",
        "date": "2026-11-25 06:36 UTC",
        "machine": dict(MACHINE),
        "summary": {
            "policy": "ssp:1" if policy == "delay-1" else policy,
            "workers": 2,
            "epochs": 8,
            "test_accuracy": accuracy,
            "samples_per_s": 51234.5,
            "wall_s": 18.24,
            "max_staleness": 1,
            "run_dir": "runs/x",
        },
    }


def _bench(tmp_path: Path, name: str, *lines: dict) -> None:
    (tmp_path / f"{name}.json").write_text("".join(json.dumps(ln) + "\n" for ln in lines))


def test_the_block_holds_the_records_figures_date_machine_and_make_runs_summary() -> None:
    block = readme.block([_record("sync", 0.891), _record("delay-1", 0.8915)], {})
    assert block.startswith(readme.BEGIN) and block.endswith(readme.END)
    assert (
        "`paramserver launch --workers 2 --policy POLICY`, measured 2026-11-25 06:36 UTC" in block
    )
    assert "Test CPU, 2 cores, 24 GiB, GPU none; torch 2.13.0" in block
    assert "| sync | 89.10% | 51,234 | 18.2 |" in block
    assert (
        "`delay-1 (ssp:1), 2 workers, 8 epochs: test accuracy 89.15%, 51234 samples/s, "
        "wall 18.2s, "
        "max staleness 1; run folder runs/x`"
    ) in block


def test_a_bench_figure_is_quoted_only_from_a_dated_latest_line(tmp_path: Path) -> None:
    dated = {"date": "2026-11-26 10:00 UTC", "ps_vs_ddp": {"async": 3.04}, "target_ps_vs_ddp": 1.5}
    _bench(tmp_path, "straggler", {"ps_vs_ddp": {"async": 1.5}}, dated)
    # An older line with a date does not stand for a newer one without.
    _bench(tmp_path, "transport", {"date": "2026-11-20", "push_vs_tcp": 1.9}, {"push_vs_tcp": 0.78})
    block = readme.block([_record("sync", 0.89)], readme.load_bench(tmp_path))
    row = next(ln for ln in block.splitlines() if "`ps_vs_ddp.async`" in ln)
    assert "| 3.04 × | 1.5 × | 2026-11-26; `straggler.json` line 2 |" in row
    assert "All measured on machine not recorded." in block  # one machine: named once
    assert "1.9" not in block and "0.78" not in block
    assert "these carry none yet: `transport`." in block


def test_two_dated_runs_are_quoted_side_by_side(tmp_path: Path) -> None:
    machine = {"cpu": "C", "cores": 2, "memory_gib": 24, "gpu": "none", "torch": "t", "python": "p"}
    old = {"date": "2026-11-20 09:00 UTC", "push_vs_tcp": 1.9}
    a = {"date": "2026-11-26 10:00 UTC", "push_vs_tcp": 0.81, "machine": machine}
    b = {"date": "2026-11-26 10:04 UTC", "push_vs_tcp": 0.77, "machine": machine}
    b["target_push_vs_tcp"] = 0.6
    _bench(tmp_path, "transport", old, a, b)
    block = readme.block([_record("sync", 0.89)], readme.load_bench(tmp_path))
    row = next(ln for ln in block.splitlines() if "`push_vs_tcp`" in ln)
    assert "| 0.81 / 0.77 × | 0.6 × | 2026-11-26; `transport.json` lines 2, 3 |" in row, row
    assert "All measured on C, 2 cores" in block  # one machine: named once, not a row each
    assert "1.9" not in block


def test_a_run_of_some_cases_leaves_the_other_figures_to_the_runs_that_hold_them(
    tmp_path: Path,
) -> None:
    """``bench network --only`` writes a line with only its variants' figures: each figure
    is quoted from the two latest dated lines that hold it."""
    a = {"date": "2026-11-26 10:00 UTC", "push_vs_tcp": 0.81, "push_remote_vs_tcp": 0.5}
    b = {"date": "2026-11-26 11:00 UTC", "push_vs_tcp": 0.77, "push_remote_vs_tcp": 0.6}
    some = {"date": "2026-11-27 10:00 UTC", "push_vs_tcp": 0.9}
    _bench(tmp_path, "transport", a, b, some)
    block = readme.block([_record("sync", 0.89)], readme.load_bench(tmp_path))
    push = next(ln for ln in block.splitlines() if "`push_vs_tcp`" in ln)
    pull = next(ln for ln in block.splitlines() if "`push_remote_vs_tcp`" in ln)
    assert "| 0.77 / 0.90 × |" in push and "`transport.json` lines 2, 3 |" in push, push
    assert "| 0.50 / 0.60 × |" in pull and "`transport.json` lines 1, 2 |" in pull, pull


def test_a_grouped_benchmark_is_read_from_its_sub_folder_and_a_shared_source_said_once(
    tmp_path: Path,
) -> None:
    """``docs/bench/sparse/criteo.json`` holds the Criteo figures: its rows name that file;
    a row whose runs are the row above's says "as above"; an AUC loss's target reads as
    the least the figure may be. A sub-folder not in ``GROUPED`` is not read."""
    a = {
        "date": "2026-11-27 10:00 UTC",
        "criteo_auc_delta": -0.00031,
        "criteo_sparse_vs_local": 0.6,
    }
    b = {"date": "2026-11-27 11:00 UTC", "criteo_auc_delta": 0.00012, "criteo_sparse_vs_local": 0.9}
    b["target_criteo_auc_delta"] = 0.002
    (tmp_path / "sparse").mkdir()
    _bench(tmp_path / "sparse", "criteo", a, b)
    (tmp_path / "control-path").mkdir()
    _bench(tmp_path / "control-path", "transport", {"date": "2026-11-27", "push_vs_tcp": 9.9})
    block = readme.block([_record("sync", 0.89)], readme.load_bench(tmp_path))
    auc = next(ln for ln in block.splitlines() if "`criteo_auc_delta`" in ln)
    speed = next(ln for ln in block.splitlines() if "`criteo_sparse_vs_local`" in ln)
    assert "| -0.0003 / 0.0001 | ≥ −0.002 | 2026-11-27; `sparse/criteo.json` lines 1, 2 |" in auc
    assert speed.endswith("| 0.60 / 0.90 × |  | as above |"), speed
    assert "9.9" not in block and "push_vs_tcp" not in block


def test_a_readme_without_the_markers_is_an_error() -> None:
    with pytest.raises(click.ClickException, match="no block"):
        readme.render("# README\n", [_record("sync", 0.89)], {})


def test_render_rewrites_only_the_block() -> None:
    text = f"before\n{readme.BEGIN}\nstale 1.7 ×\n{readme.END}\nafter\n"
    out = readme.render(text, [_record("sync", 0.89)], {})
    assert out.startswith("before\n") and out.endswith("\nafter\n")
    assert "stale" not in out and "| sync | 89.00% |" in out


def test_the_summary_in_the_block_is_the_one_launch_prints(capsys, monkeypatch) -> None:
    """The block's make-run line is launch's own summary line for the delay-1 record."""
    import paramserver.cluster.launch
    from paramserver import cli

    record = json.loads((ROOT / "docs" / "results" / "main-delay-1.json").read_text())
    # What launch returns for that run; a record older than policy_label lacks it.
    summary = {**record["summary"], "policy_label": readme.label(record)}
    monkeypatch.setattr(paramserver.cluster.launch, "launch", lambda cfg: summary)
    for name in [n for n in os.environ if n.startswith("PARAMSERVER_")]:
        monkeypatch.delenv(name)
    argv = record["command"].split()[1:-1]  # launch ... without paramserver and --json
    try:
        cli.main([*argv, "--dataset", "synthetic", "--lr-schedule", "constant"])
    except SystemExit as exc:
        assert not exc.code, capsys.readouterr().err
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == readme.summary_line(record)
    assert f"`{printed}`" in (ROOT / "README.md").read_text()


def test_the_readme_stays_short() -> None:
    """A newcomer reads it whole: at most 12 KB (issue 46); the rest is in docs/."""
    size = (Path(__file__).resolve().parents[2] / "README.md").stat().st_size
    assert size <= 12 * 1024, f"README.md is {size} bytes"


def test_the_readme_names_every_debian_package_make_install_installs() -> None:
    makefile = (ROOT / "Makefile").read_text()
    line = next(ln for ln in makefile.splitlines() if ln.startswith("DEB_PACKAGES :="))
    readme = (ROOT / "README.md").read_text()
    for package in line.split(":=", 1)[1].split():
        assert f"`{package}`" in readme, package
