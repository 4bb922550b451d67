"""Settings are declared once, on the config fields: the command line parses what a
child's argv says back into the same config, for every command that starts children."""

from __future__ import annotations

import dataclasses

from paramserver import cli, settings
from paramserver.config import (
    LaunchConfig,
    OptimizerConfig,
    Security,
    ServerConfig,
    WorkerConfig,
)


def _parse(command: str, args: list[str]) -> dict:
    ctx = cli.cli.commands[command].make_context(command, list(args))
    return dict(ctx.params)


def test_a_server_config_survives_argv_and_the_command_line(tmp_path):
    cfg = ServerConfig(
        model="cnn", policy="ssp:3", workers=5, dataset="synthetic", batch_size=32, epochs=3,
        seed=7, host="127.0.0.1", port=0, lease_seconds=2.5, chunk_bytes=8192, threads=2,
        min_workers=3, checkpoint_dir=str(tmp_path), checkpoint_every="7", skip_nonfinite=True,
        metrics_port=9101, shard=1, shards=2,
        optimizer=OptimizerConfig("momentum", 0.05, 0.8, 1e-4, "cosine", 1000),
        security=Security(token="s3cret"),
    )  # fmt: skip
    args = settings.argv(cfg, exclude=("shard", "shards"))
    assert "s3cret" not in args and settings.secrets(cfg) == {"PARAMSERVER_TOKEN": "s3cret"}
    kw = _parse("server", [*args, "--shard", "1/2", "--token", "s3cret"])
    kw.pop("shard")
    assert cli.server_config(kw, shard=1, shards=2) == cfg
    assert kw == {}  # every option became a field


def test_a_worker_config_survives_argv_and_the_command_line():
    cfg = WorkerConfig(
        server="10.0.0.1:50051,10.0.0.2:50051", device="cpu", threads=3, data_dir="/data",
        rpc_timeout=12.5, barrier_timeout=99.0, max_steps=40, step_delay=0.25, name="w7",
        overlap="on", shm="off", compress="bf16", push_every=4, server_timeout=42.0,
    )  # fmt: skip
    kw = _parse("worker", ["--server", cfg.server, *settings.argv(cfg, exclude=("server",))])
    address, procs = kw.pop("server_address"), kw.pop("procs")
    assert (address, procs) == (cfg.server, 1)
    security = cli.security_config(kw)
    assert (
        WorkerConfig(server=address, security=security, **settings.values(WorkerConfig, kw)) == cfg
    )
    assert kw == {}


def test_launch_passes_its_worker_settings_to_its_workers_as_declared():
    from paramserver.cluster.launch import worker_args

    cfg = LaunchConfig(server=ServerConfig(), device="cpu", threads=2, step_delay=0.5,
                       overlap="off", shm="off", compress="fp16", push_every=2)  # fmt: skip
    args = worker_args(cfg, "127.0.0.1:1234", "worker-3")
    kw = _parse("worker", args[1:])
    got = WorkerConfig(server=kw.pop("server_address"), **settings.values(WorkerConfig, kw))
    for name in ("device", "threads", "step_delay", "overlap", "shm", "compress", "push_every"):
        assert getattr(got, name) == getattr(cfg, name), name
    assert got.name == "worker-3" and got.server == "127.0.0.1:1234"


def test_every_launch_setting_of_a_worker_is_the_worker_daemons_own():
    worker = {f.name: f for f in dataclasses.fields(WorkerConfig)}
    for f, flag in settings.declared(LaunchConfig):
        if f.name in worker:
            assert flag is worker[f.name].metadata["flag"]
            assert f.default == worker[f.name].default


def test_status_and_health_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from paramserver import cli\n"
        "for command in ('status', 'health'):\n"
        "    try:\n"
        "        cli.main([command, '--server', '127.0.0.1:1', '--timeout', '0.05'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "torch imported: False" in out.stdout, out.stdout + out.stderr


def test_a_launch_config_survives_argv_and_the_command_line():
    from paramserver.cluster.launch import launch_args

    server = ServerConfig(
        host="127.0.0.1", port=0, policy="sync", workers=3, epochs=2, dataset="synthetic",
        threads=2, min_workers=2, optimizer=OptimizerConfig("sgd", 0.1, schedule="cosine",
                                                           total_steps=50),
    )  # fmt: skip
    cfg = LaunchConfig(server=server, device="cpu", servers=2, push_every=2, run_dir="/tmp/r")
    kw = _parse("launch", launch_args(cfg)[1:])
    kw.pop("as_json"), kw.pop("progress")
    launch_kw = settings.values(LaunchConfig, kw)
    assert LaunchConfig(server=cli.server_config(kw, host="127.0.0.1", port=0), **launch_kw) == cfg
    assert kw == {}


def test_a_built_in_model_brings_its_defaults_for_what_the_command_line_leaves_unset(
    monkeypatch,
):
    from paramserver.config import MODEL_DEFAULTS

    def parsed(command: str, args: list[str]) -> dict:
        ctx = cli.cli.commands[command].make_context(command, args)
        with ctx:
            cli.model_defaults(ctx.params)
        return ctx.params

    recipe = MODEL_DEFAULTS["resnet"]
    for command in ("launch", "server"):
        kw = parsed(command, ["--model", "resnet"])
        assert (kw["epochs"], kw["lr"]) == (recipe["epochs"], recipe["lr"])
        kw = parsed(command, ["--model", "resnet", "--epochs", "3"])
        assert (kw["epochs"], kw["lr"]) == (3, recipe["lr"])
        assert parsed(command, ["--model", "mlp"])["epochs"] == 8  # no recipe: the default
    monkeypatch.setenv("PARAMSERVER_LR", "0.5")  # the environment counts as given
    assert parsed("launch", ["--model", "resnet"])["lr"] == 0.5
