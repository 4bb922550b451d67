"""A --run-dir that holds another run's metrics is refused before anything starts (it
would mix two runs' epochs in metrics.jsonl and curve.png), unless the run goes on from
its --checkpoint-dir (issue 46's walk, item 8). Its files survive a kill or a full disk in
the middle of a write (faults round 4)."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest

from paramserver.cluster import launch
from paramserver.cluster.rundir import RunDir
from paramserver.config import LaunchConfig, ServerConfig
from paramserver.errors import ConfigError


def test_a_used_folder_is_refused_unless_the_run_resumes(tmp_path: Path) -> None:
    run = RunDir("", "", tmp_path / "run")
    run.check_unused(resuming=False)  # empty: fine
    run.append_metrics({"epoch": 1, "test_accuracy": 0.8})
    run.append_metrics({"epoch": 2, "test_accuracy": 0.85})
    with pytest.raises(
        ConfigError, match=r"holds another run's metrics \(metrics.jsonl, epochs 1-2\)"
    ):
        run.check_unused(resuming=False)
    run.check_unused(resuming=True)  # its epochs follow


def test_launch_refuses_it_before_starting_anything(tmp_path: Path, monkeypatch) -> None:
    used = RunDir("", "", tmp_path / "used")
    used.append_metrics({"epoch": 1})
    started: list[str] = []

    class Started(Exception):
        pass

    def start(self):
        started.append("x")
        raise Started  # the test ends here: nothing is started for real

    monkeypatch.setattr(launch._Cluster, "start", start)
    server = ServerConfig(dataset="synthetic", workers=1, epochs=1)
    cfg = LaunchConfig(server=server, run_dir=str(used.path), progress=False)
    with pytest.raises(ConfigError, match="--run-dir .* holds another run's metrics"):
        launch.launch(cfg)
    assert started == [] and used.read_metrics() == [{"epoch": 1}]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "server.pt").write_bytes(b"x")  # a checkpoint to go on from: no refusal
    resumed = LaunchConfig(
        server=ServerConfig(dataset="synthetic", workers=1, epochs=1, checkpoint_dir=str(ckpt)),
        run_dir=str(used.path),
        progress=False,
    )
    with pytest.raises(Started):  # past the check, into the (stubbed) cluster's start
        launch.launch(resumed)
    assert started == ["x"]


def test_a_line_cut_short_by_a_kill_is_dropped_before_the_next_is_appended(
    tmp_path: Path, caplog
) -> None:
    """A kill -9 while metrics.jsonl was written leaves its last line cut short: the next
    line appended after a restart must not be glued onto it (issue round 4, defect 3)."""
    run = RunDir("", "", tmp_path / "run")
    run.file("metrics.jsonl").write_text('{"epoch": 1, "test_accuracy": 0.8}\n{"epoch": 2, "te')
    with caplog.at_level(logging.WARNING):
        run.append_metrics({"epoch": 2, "test_accuracy": 0.85})
        run.append_metrics({"epoch": 3, "test_accuracy": 0.9})
    assert run.read_metrics() == [
        {"epoch": 1, "test_accuracy": 0.8},
        {"epoch": 2, "test_accuracy": 0.85},
        {"epoch": 3, "test_accuracy": 0.9},
    ]
    assert "cut short (dropped)" in caplog.text
    only_cut = RunDir("", "", tmp_path / "only")  # killed while it wrote its first line
    only_cut.file("metrics.jsonl").write_text('{"epo')
    only_cut.append_metrics({"epoch": 1})
    assert only_cut.read_metrics() == [{"epoch": 1}]


def test_a_failed_write_leaves_the_file_as_it_was(tmp_path: Path, monkeypatch) -> None:
    """summary.json and config.json are written whole or not at all: a full disk (or a kill)
    halfway through a write leaves the old file, and no half of the new one."""
    run = RunDir("", "", tmp_path / "run")
    run.write_json("summary.json", {"test_accuracy": 0.8})
    real = Path.write_text

    def half_then_full(self: Path, text: str, *args, **kwargs) -> int:
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        run.write_json("summary.json", {"test_accuracy": 0.9, "more": "x" * 100})
    monkeypatch.undo()
    assert json.loads(run.file("summary.json").read_text()) == {"test_accuracy": 0.8}
    assert sorted(p.name for p in run.path.iterdir()) == ["summary.json"]


def test_a_failed_curve_leaves_no_half_png(tmp_path: Path, monkeypatch) -> None:
    run = RunDir("", "", tmp_path / "run")
    run.append_metrics(
        {"epoch": 1, "test_accuracy": 0.8, "test_loss": 0.5, "samples": 64, "wall_s": 1.0}
    )
    import matplotlib.figure

    def full(self, fname, **kwargs) -> None:
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    with pytest.raises(OSError, match="File too large"):
        run.plot("t")
    assert sorted(p.name for p in run.path.iterdir()) == ["metrics.jsonl"]
