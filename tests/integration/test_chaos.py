"""``paramserver chaos``, short: a real cluster (2 shards, 3 workers, a sparse table and
BatchNorm) hurt by 4 seeded server-side faults (kill -9 of every shard at once, of one
shard, a shard paused past the workers' lease, a shard's checkpoint writes failing), then
the same run uninterrupted: every batch once, each recovery bounded, every checkpoint
readable throughout, and the same weights and rows."""

from __future__ import annotations

import json
import subprocess

from tests.conftest import paramserver_cmd


def test_a_short_seeded_soak_holds_every_invariant(tmp_path):
    result = subprocess.run(
        [
            *paramserver_cmd(),
            "chaos",
            "--faults",
            "4",
            "--seed",
            "2",
            "--kinds",
            "server",
            "--workdir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.stdout.strip(), result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == (0 if report["ok"] else 1)
    assert report["checks"] == {
        "exactly_once": True,
        "workers_logs_agree": True,
        "recovered_within": True,
        "every_fault_injected": True,
        "checkpoints_readable": True,
        "equal_to_uninterrupted": True,
    }, report
    assert len(report["faults"]) == 4 and report["checkpoint_reads"] > 0
    assert {f["fault"].split(" ")[0] for f in report["faults"]} == {
        "kill-all-shards",
        "stop-shard",
        "disk-full",
        "kill-shard",
    }
    assert report["largest_weight_difference"] < 1e-4
