"""Every benchmark runs in --quick mode and reports its figures, so none can rot."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from tests import netns
from tests.conftest import paramserver_run


def _namespaces() -> set[str]:
    if netns.unavailable() is not None:
        return set()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


KEYS = {
    "transport": [
        "push_gbps",
        "pull_gbps",
        "tcp_gbps",
        "memcpy_gbps",
        "push_vs_tcp",
        "push_grpc_gbps",
        "pull_grpc_gbps",
        "push_grpc_2shards_gbps",
        "push_remote_vs_tcp",
        "pull_remote_vs_tcp",
    ],
    "step": [
        "step_vs_local",
        "local_ms_64",
        "worker_ms_256",
        "worker_overlap_ms_256",
        "worker_ms_64_grpc",
        "worker_overlap_ms_64_grpc",
    ],
    "wakeup": ["unix_socket_us", "grpc_unary_us", "futex_us", "eventfd_us"],
    "straggler": [
        "local_async_vs_sync",
        "target_local_async_vs_sync",
        "ps_vs_ddp",
        "ddp_samples_per_s",
        "async_samples_per_s",
        "delay1_samples_per_s",
        "ddp3_samples_per_s",
        "sync_backup_samples_vs_ddp",
        "sync3_samples_per_s",
        "sync_backup_accuracy",
        "sync3_accuracy",
    ],
    "scaling": [
        "local_samples_per_s",
        "sync_samples_per_s",
        "async_vs_local",
        "local_all_cores_samples_per_s",
        "async_vs_local_all_cores",
        "async_grpc_samples_per_s",
        "async_optimizer_thread_samples_per_s",
    ],
    "accuracy": ["time_to_target_s"],
    "network": [
        "tcp_gbps_1gbit",
        "push_grpc_gbps_1gbit",
        "pull_grpc_gbps_1gbit",
        "tcp_link_util_1gbit",
        "push_grpc_link_util_1gbit",
        "push_grpc_vs_tcp_1gbit",
        "push_remote_gbps_1gbit",
        "pull_remote_vs_tcp_1gbit",
        "push_link_util",
        "pull_link_util",
        "fp32_samples_vs_ddp",
        "fp32_time_to_88_vs_ddp",
        "local32_int8_samples_vs_ddp",
        "local32_int8_async_time_to_88_vs_ddp",
        "local32_int8_bytes_vs_ddp_1gbit",
        "bf16_samples_vs_ddp",
        "fp32_2shards_samples_vs_ddp",
        "topk_samples_vs_ddp",
        "bf16_bytes_vs_ddp_1gbit",
        "topk_link_util_vs_ddp_1gbit",
        "ddp_bytes_per_batch_1gbit",
        "bf16_link_util_1gbit",
    ],
    "server": [
        "sgd_16mib_apply_vs_bound",
        "adam_16mib_apply_vs_bound",
        "sgd_16mib_net_pushes_per_s",
        "adam_16mib_applied_gbps",
        "adam_16mib_bound_gbps",
        "two_shards_vs_one",
        "adam_16mib_4p_coalesce_apply_vs_bound",
        "adam_16mib_4p_coalesce_coalesced_share",
        "adam_apply_80mb_threads2_vs_1",
        "adam_16mib_coalesce_vs_off",
    ],
    "sparse": [
        "sparse_vs_dense",
        "sparse_vs_ddp",
        "auc",
        "auc_local",
        "auc_local_rows",
        "bytes_per_step_sparse",
        "bytes_per_step_dense",
        "big_table_mb",
        "big_worker_rss_mb",
        "samples_per_s",
        "big_rss_over_table",
        "lifecycle_rows_live",
        "bytes_per_row",
        "sparse_vs_dense_b1024",
        "sparse_vs_dense_dlrm",
        "criteo_samples_per_s",
        "criteo_auc",
        "criteo_auc_local",
        "criteo_auc_1_worker",
        "auc_dense_b1024",
        "auc_small_dlrm",
        "criteo_bytes_per_step",
        "criteo_rows_held",
        "export_mb",
        "export_seconds",
        "serve_first_answer_seconds",
        "auc_by_policy",
        "samples_per_s_by_policy",
        "criteo_auc_4_workers",
        "criteo_4_workers_vs_local",
        "criteo_push_ms",
        "criteo_push_server_ms",
        "target_auc_minus_ddp",
        "target_sparse_vs_local",
        "target_sparse_vs_ddp",
        "target_criteo_auc_delta",
        "target_criteo_vs_local",
        "target_criteo_push_server_ms",
    ],
}


# One bench at a time under `make test`'s processes (tests/conftest.py): each measures its
# rates over short windows, which other benches beside it starve (four at once failed);
# ``bench network`` with the other tests of network namespaces.
NAMES = [
    pytest.param(name, marks=pytest.mark.xdist_group("netns" if name == "network" else "bench"))
    for name in sorted(KEYS)
]


@pytest.mark.parametrize("name", NAMES)
def test_bench_quick_json(name):
    if name == "network" and (why := netns.unavailable()) is not None:
        pytest.skip(why)
    namespaces_before = _namespaces()
    # the CPU figures, also on a GPU host (where --device auto would measure the GPU's)
    device = ("--device", "cpu") if name in ("step", "scaling") else ()
    out = paramserver_run("bench", name, "--quick", "--json", *device, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["bench"] == name and figures["quick"] is True
    for key in KEYS[name]:
        value = figures[key]
        values = (
            value.values()
            if isinstance(value, dict)
            else value
            if isinstance(value, list)
            else [value]
        )
        assert all(v > 0 for v in values), (key, value)
    if name == "scaling":
        split = figures["cpu_ms_per_step"]
        assert set(split) == {"worker_compute", "worker_overhead", "server"}
        # a quick run's second of clock ticks: the server's share may round to 0, and the
        # overhead (the workers' CPU less a local step's) may come out below 0 on a busy host
        assert split["worker_compute"] > 0 and split["server"] >= 0
        assert all(math.isfinite(v) for v in split.values())
    if name == "step":
        assert set(figures["step_vs_local"]) == {"64", "256"}
        # clock ticks over a quick run's few steps: may round to 0
        assert figures["server_cpu_ms_64"] >= 0 and figures["server_cpu_ms_64_grpc"] >= 0
    if name == "sparse":
        # issue 44: each policy's AUC against one process's and DDP's, either sign
        assert set(figures["auc_by_policy"]) == {"sync", "delay-1", "async"}
        for key in ("auc_minus_local_by_policy", "auc_minus_ddp_by_policy"):
            assert set(figures[key]) == {"sync", "delay-1", "async"}
            assert all(math.isfinite(v) for v in figures[key].values())
        assert set(figures["criteo_push_ms"]) == {"pull", "check", "apply"}
        assert set(figures["cpu_ms_per_step"]) == {"workers", "server", "local"}
        assert figures["cpu_ms_per_step"]["workers"] > 0
        # the table's rows move, not the table: fewer bytes a step than the dense table's
        assert figures["bytes_per_step_sparse"] < figures["bytes_per_step_dense"]
        assert 0.5 < figures["auc"] < 1 and 0.5 < figures["auc_local"] < 1
        assert figures["big_table_mb"] <= figures["big_table_declared_mb"]
        # one server: the lifecycle's capacity holds, and rows went (evicted or never admitted)
        assert 0 < figures["lifecycle_rows_live"] <= figures["lifecycle_capacity"]
        assert figures["lifecycle_rows_live"] < figures["lifecycle_rows_touched"]
        assert figures["lifecycle_evicted"] > 0 and figures["lifecycle_dropped"] > 0
        assert 0.5 < figures["lifecycle_auc"] < 1 and figures["bytes_per_row"] > 0
        # a quick run's growth of a few MB may come out at or below 0 (memory given back)
        assert math.isfinite(figures["big_server_rss_mb"])
        # a difference of two AUCs: either sign, and what the two runs' AUCs say
        delta = figures["lifecycle_auc"] - figures["auc"]
        assert figures["lifecycle_auc_delta"] == pytest.approx(delta)
        # the Criteo case: the 26 tables' rows move, not the tables; AUCs of a learnt model
        assert figures["criteo_table_rows"] > figures["criteo_largest_table_rows"] >= 10_000
        moved = figures["criteo_bytes_per_step"]
        assert moved["sparse"] < moved["dense"]
        for key in ("criteo_auc", "criteo_auc_local", "auc_dense_b1024", "auc_small_dlrm"):
            assert 0.5 < figures[key] < 1, (key, figures[key])
        delta = figures["criteo_auc"] - figures["criteo_auc_local"]
        assert figures["criteo_auc_delta"] == pytest.approx(delta)
        delta = figures["criteo_auc_1_worker"] - figures["criteo_auc_local"]
        assert figures["criteo_auc_delta_1_worker"] == pytest.approx(delta)
        # rows came to exist only where pushed; the snapshot holds them and was served
        assert 0 < figures["criteo_rows_held"] < figures["criteo_table_rows"]
        assert figures["export_mb"] > figures["criteo_rows_held"] * 16 * 4 / 2**20
    if name == "straggler":
        assert set(figures["ps_vs_ddp"]) == {"async", "delay-1"}
        for policy in ("sync", "async"):  # whole local-step runs learnt something
            assert 0.3 < figures[f"local_{policy}_accuracy"] <= 1.0
        assert math.isfinite(figures["local_async_accuracy_gap_points"])  # either sign
    if name == "network":
        assert "no netem" in figures["delay"]
        # the link is shaped: nothing crosses it faster than its rate (and the bucket)
        assert figures["tcp_link_util_1gbit"] < 1.15
        # local steps: 32 batches a push of int8, pulls in bf16: a small share of DDP's bytes
        assert figures["local32_int8_bytes_vs_ddp_1gbit"] < 0.05
        assert math.isfinite(figures["local32_int8_accuracy_vs_ddp_1gbit"])  # a difference
        # overlapped local steps (issue 58) learnt; every variant's busiest link per round
        assert 0.3 < figures["local32_overlap_curve_1gbit"][-1][1] <= 1.0
        assert figures["local32_overlap_samples_per_s_1gbit"] > 0
        for name in ("ddp", "fp32", "local32_int8", "local32_overlap"):
            assert figures[f"{name}_busiest_link_bytes_per_round_1gbit"] > 0, name
        for name in ("fp32", "local32_overlap"):  # the whole process against its training
            whole = figures[f"{name}_whole_run_s_1gbit"]
            assert figures[f"{name}_whole_vs_train_1gbit"] > 1.0 and whole > 0, name
        assert _namespaces() <= namespaces_before, "the bench left namespaces behind"
    if name == "accuracy":
        # every contender reached the quick target (60% on the synthetic set) in 2 epochs
        assert set(figures["time_to_target_s"]) == {"local", "ddp", "sync", "delay-1", "async"}
        for curve in figures["curves"].values():
            assert len(curve) == 2 and all(0 < acc <= 1 for _, acc in curve)


@pytest.mark.xdist_group("bench")
def test_bench_sparse_only_main_runs_the_dlrm_targets_alone():
    """``bench sparse --only main``: (a) under each policy against (c) and (d), with the
    CPU a step, and none of the other cases."""
    out = paramserver_run("bench", "sparse", "--quick", "--json", "--only", "main", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["only"] == "main" and set(figures["auc_by_policy"]) == {
        "sync",
        "delay-1",
        "async",
    }
    assert set(figures["samples_per_s"]) == {"tables", "local", "ddp"}
    assert 0.5 < figures["auc"] < 1 and figures["cpu_ms_per_step"]["local"] > 0
    assert "criteo_auc" not in figures and "big_table_mb" not in figures


RANK = """
import json, os, sys
rank, out = int(sys.argv[1]), sys.argv[-1]
mode = sys.argv[4]
if mode == "abort-after" or (mode == "one-fails" and rank == 0):
    with open(out, "w") as f:
        json.dump({"rank": rank}, f)
    if mode == "abort-after":
        sys.stderr.write("terminate called without an active exception\\n")
        os.abort()
elif mode == "one-fails":
    sys.stderr.write("rank 1 broke\\n")
    sys.exit(3)
"""


@pytest.fixture
def fake_rank(tmp_path, monkeypatch):
    pkg = tmp_path / "fakerank"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(RANK)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    logs = tmp_path / "logs"
    logs.mkdir()
    return logs


def test_run_ranks_keeps_results_written_before_a_teardown_abort(fake_rank, capfd):
    from paramserver.bench.ddp import run_ranks

    results = run_ranks("fakerank", ["abort-after"], 2, fake_rank, "fake", timeout=60)
    assert results == [{"rank": 0}, {"rank": 1}]
    assert "after writing its result" in capfd.readouterr().err


def test_run_ranks_fails_loudly_when_a_rank_dies_without_its_result(fake_rank):
    from paramserver.bench.ddp import run_ranks

    with pytest.raises(RuntimeError, match=r"fake rank 1 failed \(exit 3\): rank 1 broke"):
        run_ranks("fakerank", ["one-fails"], 2, fake_rank, "fake", timeout=60)
