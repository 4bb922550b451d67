"""A --run-dir that holds another run's metrics is refused before anything starts (it
would mix two runs' epochs in metrics.jsonl and curve.png), unless the run goes on from
its --checkpoint-dir (issue 46's walk, item 8)."""

from __future__ import annotations

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
