"""The command line: help, bad arguments (one clear line, non-zero exit), status, launch."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from paramserver import models
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.server.build import build_coordinator
from paramserver.server.disk import checkpoint
from paramserver.server.disk.checkpoint_writer import Checkpointer
from tests.conftest import DEADLINE, launch_json, paramserver_popen, paramserver_run


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = DEADLINE
) -> subprocess.CompletedProcess:
    return paramserver_run(*args, timeout=timeout, env={**os.environ, **(env or {})})


def test_every_option_has_help_and_an_environment_variable():
    for command in ("server", "worker", "launch", "status", "health", "plot"):
        out = run_cli(command, "--help")
        assert out.returncode == 0, out.stderr
        options = [
            line
            for line in out.stdout.splitlines()
            # an option's own line (a wrapped help line may start with an --option too)
            if re.match(r"^  -?-\w", line) and "--help" not in line
        ]
        assert options, out.stdout
        text = out.stdout.replace("\n", " ")
        assert text.count("PARAMSERVER_") >= len(options), f"{command}: an option lacks an env var"


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["server", "--policy", "sometimes", "--port", "0"],
            "Unknown staleness policy (--policy) 'sometimes'",
        ),
        (["server", "--workers", "0", "--port", "0"], "--workers must be at least 1; got 0"),
        (["server", "--lr", "-1", "--port", "0"], "learning rate (--lr) must be a positive"),
        (["server", "--optimizer", "lbfgs"], "Unknown optimizer (--optimizer) 'lbfgs'"),
        (
            ["server", "--lr-schedule", "cosine", "--port", "0"],
            "--lr-schedule cosine needs --lr-total-steps",
        ),
        (["server", "--model", "nosuchmodel", "--port", "0"], "Unknown model 'nosuchmodel'"),
        (["worker", "--server", "localhost"], "--server must look like HOST:PORT"),
        (
            ["worker", "--server", "127.0.0.1:1", "--server-timeout", "0.5"],
            "No parameter server answered at 127.0.0.1:1",
        ),
        (
            ["worker", "--server", "127.0.0.1:1", "--device", "tpu"],
            "--device must be auto, cpu, cuda or cuda:N",
        ),
        (
            ["launch", "--data-dir", "/nonexistent", "--workers", "1"],
            "Fashion-MNIST not found in /nonexistent",
        ),
        (
            ["status", "--server", "127.0.0.1:1", "--rpc-timeout", "0.5"],
            "No parameter server answered",
        ),
        (["launch", "--epochs", "x"], "'x' is not a valid integer"),
        (["server", "--checkpoint-every", "often", "--port", "0"], "--checkpoint-every must be"),
        (
            ["server", "--min-workers", "3", "--workers", "2", "--port", "0"],
            "--min-workers must be",
        ),
        (
            ["server", "--tls-cert", "/nonexistent.pem", "--tls-key", "/x", "--port", "0"],
            "--tls-cert '/nonexistent.pem' is not a readable file",
        ),
        (
            ["health", "--server", "127.0.0.1:1", "--rpc-timeout", "0.5"],
            "No parameter server answered",
        ),
        (["plot", "/"], "holds no metrics.jsonl"),
        (["worker", "--epochs", "1"], "--epochs is the server's: the server owns the run's plan"),
        (["worker", "--model", "cnn"], "give --model to `paramserver server` (or `launch`)"),
        (["worker", "--procz", "2"], "Did you mean '--procs'?"),  # a typo: click's guess
        (["export", "/", "--model", "mlp"], "holds no server checkpoints"),
    ],
)
def test_bad_arguments_give_one_clear_line_and_a_non_zero_exit(args, message):
    out = run_cli(*args)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("paramserver: error: "), out.stderr
    assert message in lines[-1], out.stderr
    assert "Traceback" not in out.stderr


def test_a_port_in_use_is_reported(serve):
    server = serve("mlp", host="127.0.0.1")
    out = run_cli("server", "--host", "127.0.0.1", "--port", str(server.port))
    assert out.returncode == 2
    assert f"Cannot listen on 127.0.0.1:{server.port}" in out.stderr.strip().splitlines()[-1]


def test_environment_variables_set_options():
    out = run_cli("server", "--port", "0", env={"PARAMSERVER_POLICY": "never"})
    assert out.returncode == 2
    assert "Unknown staleness policy (--policy) 'never'" in out.stderr


def test_status_prints_a_table_and_json(serve):
    server = serve("mlp", policy="ssp:2", workers=3)
    table = run_cli("status", "--server", server.address)
    assert table.returncode == 0, table.stderr
    assert "policy ssp:2" in table.stdout
    as_json = run_cli("status", "--server", server.address, "--json")
    status = json.loads(as_json.stdout)
    assert status["policy"] == "ssp:2"
    assert status["world_size"] == 3
    assert status["version"] == 0  # int64 fields as numbers, not protobuf JSON's strings
    assert status["pushes_coalesced"] == 0 and status["apply_failures"] == 0
    assert status["train_loss"] is None  # no push yet: null, not the string "NaN"


def test_health_says_serving_and_status_watch_redraws(serve):
    server = serve("mlp")
    out = run_cli("health", "--server", server.address)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{server.address} SERVING"
    proc = paramserver_popen(
        "status",
        "--server",
        server.address,
        "--watch",
        "0.2",
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        seen = [proc.stdout.readline() for _ in range(40)]
        assert sum("policy ssp:1" in line for line in seen) >= 2, seen
    finally:
        proc.kill()
        proc.wait(DEADLINE)


def test_a_worker_without_its_data_fails_with_one_line(serve):
    server = serve("mlp", dataset="fashion-mnist")
    out = run_cli("worker", "--server", server.address, "--data-dir", "/nonexistent")
    assert out.returncode == 2
    assert "Fashion-MNIST not found in /nonexistent" in out.stderr.strip().splitlines()[-1]
    assert server.status()["workers"] == []  # it left the run on the way out


def test_a_metrics_port_in_use_is_reported(serve):
    server = serve("mlp", host="127.0.0.1", metrics_port=0)
    out = run_cli(
        "server", "--host", "127.0.0.1", "--port", "0", "--metrics-port", str(server.metrics.port)
    )
    assert out.returncode == 2
    assert f"Cannot serve metrics on 127.0.0.1:{server.metrics.port}" in out.stderr


def test_launch_json_on_synthetic_data(tmp_path):
    summary, _ = launch_json(
        tmp_path,
        "--dataset",
        "synthetic",
        "--workers",
        "2",
        "--epochs",
        "2",
        "--policy",
        "sync",
        "--lr-schedule",
        "cosine",
        "--lr",
        "0.003",
    )
    for key in (
        "policy",
        "workers",
        "epochs",
        "test_accuracy",
        "samples_per_s",
        "wall_s",
        "max_staleness",
        "run_dir",
    ):
        assert key in summary
    assert summary["policy"] == "sync"
    assert summary["max_staleness"] == 0
    assert summary["samples"] == 2 * 2 * (4096 // 2 // 64) * 64
    assert summary["test_accuracy"] > 0.5
    run_dir = tmp_path / os.path.basename(summary["run_dir"])
    for name in (
        "config.json",
        "metrics.jsonl",
        "curve.png",
        "checkpoint.pt",
        "summary.json",
        "server.log",
        "worker-0.log",
    ):
        assert (run_dir / name).exists(), name
    config = json.loads((run_dir / "config.json").read_text())
    assert config["server"]["optimizer"]["total_steps"] == 2 * (4096 // 2 // 64)  # sync rounds
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [1, 2]


def test_launch_fails_fast_when_a_worker_cannot_start(tmp_path):
    # A model that only the workers cannot build (as a GPU a worker's host lacks): the run
    # could never start, so launch must say why at once instead of waiting out the barrier.
    (tmp_path / "workerless.py").write_text(
        "import sys\nfrom torch import nn\n\n"
        "def model():\n"
        "    if 'worker' in sys.argv:\n"
        "        raise RuntimeError('this worker cannot build the model')\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))\n"
    )
    out = paramserver_run(
        *("launch", "--model", "workerless:model", "--dataset", "synthetic"),
        *("--workers", "2", "--device", "cpu", "--no-progress", "--runs-dir", "runs"),
        timeout=90,
        cwd=tmp_path,
    )
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1 and "Workers failed: " in last, out.stderr[-2000:]
    assert "RuntimeError: this worker cannot build the model" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_launch_refuses_a_gpu_this_torch_does_not_see_before_anything_starts(tmp_path):
    out = run_cli("launch", "--device", "cuda", "--runs-dir", str(tmp_path / "runs"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--device cuda asks for a GPU" in out.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "runs").exists()  # nothing started, no run folder


def test_worker_procs_starts_several_processes(serve):
    server = serve("mlp", workers=2, dataset="synthetic", batch_size=32, policy="delay-1")
    out = run_cli(
        "worker", "--server", server.address, "--procs", "2", "--max-steps", "3", "--device", "cpu"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    status = server.status()
    assert status["workers_joined"] == 2
    assert status["pushes_applied"] == 6
    assert status["workers"] == []  # both left cleanly
    # each process's lines on the terminal, prefixed with its rank once it joined (as
    # torchrun does), one line each at the end and a total; logs named by rank
    lines = out.stderr.splitlines()
    for rank in (0, 1):
        assert any(re.match(rf"\[rank {rank}\] .*joined .*\(rank {rank} of 2\)", x) for x in lines)
        assert f"[rank {rank}] done: 3 steps, 96 samples in " in out.stderr
    assert "2 worker processes: 2 done, 0 failed; 192 samples in all; logs in " in lines[-1]
    logdir = Path(lines[-1].rsplit("logs in ", 1)[1])
    assert sorted(p.name for p in logdir.iterdir()) == ["rank-0.log", "rank-1.log"]
    assert "(rank 1 of 2)" in (logdir / "rank-1.log").read_text()


def test_worker_procs_exits_non_zero_and_says_which_failed():
    out = run_cli(
        *("worker", "--server", "127.0.0.1:1", "--procs", "2", "--server-timeout", "0.5"),
        *("--device", "cpu"),
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "2 worker processes: 0 done, 2 failed" in out.stderr.splitlines()[-1]
    for i in (0, 1):  # never joined: still named by process
        assert f"[proc {i}] exited with code 1: paramserver: error: No parameter server" in (
            out.stderr
        )


def test_launch_trains_on_a_users_data_set(tmp_path):
    out = run_cli(
        "launch",
        "--dataset",
        "tests.user_data:small",
        "--workers",
        "2",
        "--epochs",
        "3",
        "--policy",
        "sync",
        "--device",
        "cpu",
        "--json",
        "--no-progress",
        "--lr",
        "0.003",
        "--runs-dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 3 * (512 // 64) * 64  # every batch of the user's set, once
    assert summary["test_accuracy"] > 0.5  # evaluated on the user's test set


def test_launch_trains_the_resnet_with_its_buffers(tmp_path):
    """The BatchNorm model through launch: its own defaults (10 epochs) unless --epochs is
    given, an evaluation that uses the shared statistics, and a checkpoint that loads with
    strict=True."""
    summary, _ = launch_json(
        tmp_path,
        "--model",
        "resnet",
        "--dataset",
        "synthetic",
        "--workers",
        "2",
        "--epochs",
        "2",
    )
    assert summary["epochs"] == 2 and summary["test_accuracy"] > 0.5
    config = json.loads(
        (tmp_path / os.path.basename(summary["run_dir"]) / "config.json").read_text()
    )
    assert config["server"]["optimizer"]["lr"] == 2e-3  # resnet's own default
    state = checkpoint.load(tmp_path / os.path.basename(summary["run_dir"]) / "checkpoint.pt")
    model = models.build("resnet")
    model.load_state_dict(state["model_state_dict"], strict=True)
    assert model[1].num_batches_tracked.item() > 0 and model[1].running_var.mean() != 1.0


def test_a_users_data_set_that_cannot_load_is_one_line(tmp_path):
    out = run_cli("launch", "--dataset", "tests.user_data:broken", "--runs-dir", str(tmp_path))
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("paramserver: error: Dataset factory 'tests.user_data:broken' failed")


def test_launch_trains_dlrm_on_the_click_log_and_reports_auc(tmp_path):
    """``--model dlrm`` alone brings ``--dataset clicks`` and its other defaults; launch
    reports the test AUC per epoch and in the summary."""
    summary, _ = launch_json(
        tmp_path,
        "--model",
        "dlrm",
        "--workers",
        "2",
        "--epochs",
        "1",
    )
    assert summary["samples"] == (200_000 // 256) * 256  # every batch of the log, once
    assert summary["test_auc"] > 0.7  # an untrained model scores 0.5
    run_dir = tmp_path / os.path.basename(summary["run_dir"])
    config = json.loads((run_dir / "config.json").read_text())
    assert config["server"]["dataset"] == "clicks" and config["server"]["batch_size"] == 256
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert epochs[-1]["test_auc"] == summary["test_auc"]


def test_a_bad_config_file_is_one_line_naming_the_file_the_key_and_the_value(tmp_path):
    config = tmp_path / "paramserver.toml"
    config.write_text('[server]\nbatch-size = "big"\n')
    out = run_cli("server", "--port", "0", "--config", str(config))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f'paramserver: error: {config}: [server] batch-size = "big": '
        "'big' is not a valid integer."
    )


def test_launch_trains_with_the_settings_of_a_config_file(tmp_path):
    """The file's [launch] table reaches the run (and through launch's argv its server and
    worker processes); the command line wins over it."""
    config = tmp_path / "paramserver.toml"
    config.write_text(
        f'[launch]\ndataset = "synthetic"\nworkers = 1\nepochs = 1\npolicy = "sync"\n'
        f'device = "cpu"\nlr = 0.003\njson = true\nprogress = false\nruns-dir = "{tmp_path}"\n'
        f'batch-size = 64\n[server]\npolicy = "async"\n'
    )
    out = run_cli("launch", "--config", str(config), "--batch-size", "128")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert (summary["policy"], summary["workers"], summary["epochs"]) == ("sync", 1, 1)
    assert summary["samples"] == (4096 // 128) * 128
    run_dir = tmp_path / os.path.basename(summary["run_dir"])
    server = json.loads((run_dir / "config.json").read_text())["server"]
    assert (server["batch_size"], server["optimizer"]["lr"]) == (128, 0.003)


def test_a_resume_under_another_optimizer_is_one_line_naming_both_and_the_option(tmp_path):
    written = ServerConfig(checkpoint_dir=str(tmp_path), optimizer=OptimizerConfig("adam"))
    Checkpointer(build_coordinator(written), tmp_path, "60s", cuts=False).stop()
    args = ("server", "--host", "127.0.0.1", "--port", "0", "--dataset", "synthetic")
    out = run_cli(
        *args, "--run-dir", "off", "--checkpoint-dir", str(tmp_path), "--optimizer", "sgd"
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"paramserver: error: The checkpoint in {tmp_path} was written by a server of "
        "--optimizer adam, whose state --optimizer sgd cannot go on from: give "
        "--switch-optimizer to start sgd's state afresh (the weights and the rest of the run "
        "go on), or resume with --optimizer adam."
    )
