"""A launch interrupted (Ctrl-C) and run again with the same --checkpoint-dir goes on at
once: its servers drop the workers the checkpoint names (launch started them and knows they
are gone), and the console goes on from the epoch the run is in."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from tests.conftest import DEADLINE, paramserver_popen, paramserver_run


def _launch(runs: Path, checkpoints: Path) -> list[str]:
    """``paramserver launch``'s arguments."""
    return [
        *("launch", "--model", "mlp", "--dataset", "synthetic", "--workers", "2"),
        *("--epochs", "8", "--batch-size", "16", "--policy", "async", "--device", "cpu"),
        *("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "20"),
        *("--runs-dir", str(runs), "--no-progress", "--json"),
    ]


def test_a_resumed_launch_goes_on_at_once_from_the_epoch_it_is_in(tmp_path):
    runs, checkpoints = tmp_path / "runs", tmp_path / "ckpt"
    # SIGINT as a terminal's ^C: the suite does not ignore it (tests/conftest.py), so
    # neither does the launch, nor its children
    first = paramserver_popen(
        *_launch(runs, checkpoints), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert first.stderr is not None
        seen = []
        for line in first.stderr:  # the first epoch's evaluation: the run is past it
            seen.append(line)
            if "epoch 2:" in line:
                break
        else:
            raise AssertionError("the first launch ended before epoch 2: " + "".join(seen)[-2000:])
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=DEADLINE)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=DEADLINE)
    second = paramserver_run(*_launch(runs, checkpoints))
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    run = Path(summary["run_dir"])
    assert "resumed from" in second.stderr and "epoch 1:" not in second.stderr, second.stderr
    said = (run / "server.log").read_text()
    assert "dropped the 2 workers the checkpoint names (--forget-workers)" in said, said[-3000:]
    for worker in ("worker-0", "worker-1"):
        text = (run / f"{worker}.log").read_text()
        assert "RESOURCE_EXHAUSTED" not in text and "are live" not in text, text[-2000:]
    epochs = [
        json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    assert epochs and epochs[0] >= 2 and epochs[-1] == 8, epochs
