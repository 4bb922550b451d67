"""docs/BENCHMARKS.md is a reference whose figures are generated: each benchmark's table is
what the kept lines of docs/bench render, every figure it names is in them, the page stays
short, and every link into it lands on a heading. Nothing is measured here."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import click
import pytest

from paramserver.bench import BENCHMARKS
from paramserver.bench.report import benchmarks, readme, results
from paramserver.bench.report.sections import SECTIONS

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "BENCHMARKS.md"


def _records() -> dict[str, list[readme.Line]]:
    return readme.load_bench(ROOT / "docs" / "bench")


def test_the_pages_tables_are_what_the_kept_lines_render() -> None:
    text = PAGE.read_text()
    assert benchmarks.render(text, _records()) == text, (
        "docs/BENCHMARKS.md's tables are stale: python -m paramserver.bench.report.results --render"
    )


def test_the_page_is_a_reference_not_a_notebook() -> None:
    size = PAGE.stat().st_size
    assert size <= 40 * 1024, f"docs/BENCHMARKS.md is {size} bytes"


def test_every_benchmark_has_a_section_and_every_figure_named_is_quoted() -> None:
    """A key that no kept line holds (a typo, a figure renamed in the code) would silently
    drop its row: each one must be quoted, from a dated line."""
    assert set(BENCHMARKS) <= set(SECTIONS)
    text = PAGE.read_text()
    for name, figures in SECTIONS.items():
        block = text[text.index(benchmarks.begin(name)) : text.index(benchmarks.end(name))]
        missing = [f.key for f in figures if f"(`{f.key}`)" not in block]
        assert not missing, f"{name}: no dated line of docs/bench holds {missing}"


def test_a_block_names_the_runs_machine_date_and_commit(tmp_path: Path) -> None:
    machine = {"cpu": "C", "cores": 2, "memory_gib": 24, "gpu": "none", "torch": "t", "python": "p"}
    old = {"date": "2026-11-20 09:00 UTC", "pipe_us": 99.0}
    a = {"date": "2026-12-02 10:00 UTC", "pipe_us": 70.25, "machine": machine, "commit": "abc1234"}
    b = {**a, "date": "2026-12-02 10:05 UTC", "pipe_us": 71.5, "commit": "def5678"}
    (tmp_path / "wakeup.json").write_text("\n".join(json.dumps(x) for x in (old, a, b)) + "\n")
    block = benchmarks.block("wakeup", readme.load_bench(tmp_path))
    row = next(ln for ln in block.splitlines() if "(`pipe_us`)" in ln)
    assert "| 70.2 / 71.5 µs |" in row, row
    assert "2026-12-02; `wakeup.json` lines 2, 3; commit abc1234, def5678 |" in row, row
    assert "All measured on C, 2 cores" in block and "99" not in block


def test_a_benchmark_without_a_dated_line_says_so_and_how_to_measure_it(tmp_path: Path) -> None:
    (tmp_path / "wakeup.json").write_text(json.dumps({"pipe_us": 70.0}) + "\n")
    block = benchmarks.block("wakeup", readme.load_bench(tmp_path))
    assert "its newest line carries no date" in block and "70" not in block
    assert "`paramserver bench wakeup --json` measures it" in block
    block = benchmarks.block("criteo", {})
    assert "no line of it is kept" in block and "bench sparse --only criteo --json" in block


def test_a_page_without_a_benchmarks_markers_is_an_error() -> None:
    text = PAGE.read_text().replace(benchmarks.end("server"), "")
    with pytest.raises(click.ClickException, match="no block between"):
        benchmarks.render(text, _records())


def test_a_lines_commit_is_the_checkouts_and_says_when_the_tree_differs() -> None:
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    got = results.commit()
    assert got is not None and got.split("+")[0] == head.stdout.strip()
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert got.endswith("+changes") == bool(changed)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", ["BENCHMARKS.md", "architecture.md"])
def test_every_link_to_a_docs_heading_lands_on_one(page: str) -> None:
    target = (ROOT / "docs" / page).read_text()
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", target, re.M)}
    sources = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    broken = [
        f"{src.name}: {found}"
        for src in sources
        for found in re.findall(rf"(?<![\w/]){re.escape(page)}#([\w\-]+)", src.read_text())
        if found not in anchors
    ]
    broken += [  # and the page's own links to itself
        f"{page}: {found}"
        for found in re.findall(r"\]\(#([\w\-]+)\)", target)
        if found not in anchors
    ]
    assert not broken, broken


def test_the_anchor_is_githubs() -> None:
    assert _anchor("sparse: a DLRM's table as server rows") == "sparse-a-dlrms-table-as-server-rows"
    assert _anchor("scaling: 1, 2 and 4 workers") == "scaling-1-2-and-4-workers"
