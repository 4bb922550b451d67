"""docs/RESULTS.md is written from the runs' JSON records, and only from them."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

from paramserver.bench.report import results

# what results.machine() records, for the records the tests make
MACHINE = {
    "cpu": "Test CPU",
    "cores": 2,
    "memory_gib": 24,
    "gpu": "none",
    "torch": "2.13.0",
    "python": "3.11.7",
}


def _record(name: str, section: str, policy: str, accuracy: float) -> dict:
    return {
        "name": name,
        "section": section,
        "command": f"paramserver launch --policy {policy} --json",
        "date": "2026-11-25 06:00 UTC",
        "machine": dict(MACHINE),
        "summary": {
            "policy": policy,
            "test_accuracy": accuracy,
            "samples_per_s": 51234.5,
            "train_s": 9.4,
            "wall_s": 18.2,
            "max_staleness": 1,
            "version": 7496,
        },
        "epochs": [0.85, accuracy],
    }


def test_the_page_holds_every_records_figures_and_the_machine(tmp_path: Path) -> None:
    for policy in ("async", "sync"):
        r = _record(f"main-{policy}", "main", policy, 0.8912)
        (tmp_path / f"main-{policy}.json").write_text(json.dumps(r))
    page = results.render(results.load(tmp_path))
    assert "Test CPU, 2 cores, 24 GiB, GPU none; torch 2.13.0" in page
    assert "2026-11-25" in page
    assert "| sync | 89.12% | 51,234 | 9.4 | 18.2 | 1 | 7,496 |" in page
    assert page.index("| sync |") < page.index("| async |"), "the policies' order, not the files'"
    assert "- async: 85.00, 89.12" in page
    assert "ResNet" not in page, "no records, no section"


def test_no_records_is_an_error_not_an_empty_page(tmp_path: Path) -> None:
    with pytest.raises(click.ClickException, match="No records"):
        results.render(results.load(tmp_path))


def test_the_kept_records_render_the_committed_page() -> None:
    """docs/RESULTS.md is exactly what the records in docs/results/ give."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    if not (docs / "results").is_dir():
        pytest.skip("no docs/results/ in this checkout")
    assert (docs / "RESULTS.md").read_text() == results.render(results.load(docs / "results"))
