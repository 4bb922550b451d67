"""Settings are declared once, on the config fields: the command line parses what a
child's argv says back into the same config, for every command that starts children."""

from __future__ import annotations

import dataclasses

from paramserver import cli, settings
from paramserver.cluster import commands
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
        model="cnn",
        policy="ssp:3",
        workers=5,
        dataset="synthetic",
        batch_size=32,
        epochs=3,
        seed=7,
        host="127.0.0.1",
        port=0,
        lease_seconds=2.5,
        chunk_bytes=8192,
        threads=2,
        min_workers=3,
        checkpoint_dir=str(tmp_path),
        checkpoint_every="7",
        skip_nonfinite=True,
        metrics_port=9101,
        shard=1,
        shards=2,
        optimizer=OptimizerConfig("momentum", 0.05, 0.8, 1e-4, "cosine", 1000),
        security=Security(token="s3cret"),
    )
    args = settings.argv(cfg, exclude=("shard", "shards"))
    assert "s3cret" not in args and settings.secrets(cfg) == {"PARAMSERVER_TOKEN": "s3cret"}
    kw = _parse("server", [*args, "--shard", "1/2", "--token", "s3cret"])
    kw.pop("shard")
    assert cli.server_config(kw, shard=1, shards=2) == cfg
    # the server's own report: its run folder and test set
    assert settings.build(commands.ServerRun, kw) == commands.ServerRun("auto", None)
    assert kw == {}  # every option became a field


def test_a_worker_config_survives_argv_and_the_command_line():
    cfg = WorkerConfig(
        server="10.0.0.1:50051,10.0.0.2:50051",
        device="cpu",
        threads=3,
        data_dir="/data",
        rpc_timeout=12.5,
        barrier_timeout=99.0,
        max_steps=40,
        step_delay=0.25,
        name="w7",
        overlap="on",
        shm="off",
        compress="bf16",
        push_every=4,
        server_timeout=42.0,
    )
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

    cfg = LaunchConfig(
        server=ServerConfig(),
        device="cpu",
        threads=2,
        step_delay=0.5,
        overlap="off",
        shm="off",
        compress="fp16",
        push_every=2,
    )
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


def _printed(*lines: str) -> str:
    """What a fresh interpreter running ``lines`` prints (and says on stderr)."""
    import subprocess
    import sys

    code = "\n".join(["import sys", *lines])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def test_status_and_health_do_not_import_torch():
    out = _printed(
        "from paramserver import cli",
        "for command in ('status', 'health'):",
        "    try:",
        "        cli.main([command, '--server', '127.0.0.1:1', '--rpc-timeout', '0.05'])",
        "    except SystemExit:",
        "        pass",
        "print('torch imported:', 'torch' in sys.modules)",
    )
    assert "torch imported: False" in out, out


def test_a_server_or_a_worker_starts_without_torchs_compiler():
    """torch._dynamo is loaded by the first table made (``torch.compiler.disable`` on its
    host lookup), not by importing the server or the worker: it was half of each process's
    start."""
    out = _printed(
        "import paramserver.server.app, paramserver.worker.worker, paramserver.cli.main",
        "print('dynamo:', 'torch._dynamo' in sys.modules)",
        "from paramserver.sparse.declared import Embedding",
        "Embedding(10, 4)",
        "print('dynamo after a table:', 'torch._dynamo' in sys.modules)",
    )
    assert "dynamo: False" in out and "dynamo after a table: True" in out, out


def test_a_launch_config_survives_argv_and_the_command_line():
    from paramserver.cluster.launch import launch_args

    server = ServerConfig(
        host="127.0.0.1",
        port=0,
        policy="sync",
        workers=3,
        epochs=2,
        dataset="synthetic",
        threads=2,
        min_workers=2,
        optimizer=OptimizerConfig("sgd", 0.1, schedule="cosine", total_steps=50),
    )
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


def _tls_files(tmp_path) -> Security:
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("-")
    return Security(
        cert=str(tmp_path / "cert.pem"),
        key=str(tmp_path / "key.pem"),
        ca=str(tmp_path / "ca.pem"),
        token="s3cret",
    )


def test_every_childs_argv_is_derived_from_its_config_and_parses_back_into_it(
    tmp_path, monkeypatch
):
    """config -> argv (``cluster/commands.py``) -> the command line -> the same config."""
    from paramserver.cluster.commands import (
        LaunchOutput,
        Procs,
        launch_args,
        server_args,
        worker_command,
    )

    security = _tls_files(tmp_path)
    # The token never goes by argv: the child inherits it by its variable.
    monkeypatch.setenv("PARAMSERVER_TOKEN", "s3cret")
    server = ServerConfig(
        model="cnn",
        policy="ssp:3",
        workers=4,
        min_workers=2,
        dataset="synthetic",
        epochs=3,
        host="127.0.0.1",
        port=0,
        threads=2,
        shard=2,
        shards=3,
        checkpoint_dir=str(tmp_path),
        checkpoint_every="7",
        optimizer_thread=True,
        metrics_port=0,
        metrics_host="0.0.0.0",
        optimizer=OptimizerConfig("sgd", 0.5, schedule="cosine", total_steps=9),
        security=security,
    )
    args = server_args(server)
    assert args[0] == "server" and "s3cret" not in args and "2/3" in args
    assert cli.server_config(_parse("server", args[1:])) == server

    worker = WorkerConfig(
        "10.0.0.1:1,10.0.0.2:2",
        device="cpu",
        threads=2,
        max_steps=5,
        name="w",
        shm="off",
        compress="fp16",
        security=security,
    )
    args = worker_command(worker)
    assert args[0] == "worker" and "s3cret" not in args
    kw = _parse("worker", args[1:])
    assert settings.build(Procs, kw) == Procs()
    assert settings.build(WorkerConfig, kw) == worker and kw == {}

    launch = LaunchConfig(
        server=dataclasses.replace(
            server,
            security=Security(),
            shard=0,
            shards=1,
            metrics_port=None,
            metrics_host="127.0.0.1",
        ),
        progress=False,
        servers=3,
        cache_rows=99,
        overlap="on",
    )
    kw = _parse("launch", launch_args(launch)[1:])
    assert settings.build(LaunchOutput, kw) == LaunchOutput()
    local = cli.server_config(kw, host="127.0.0.1", port=0)
    assert settings.build(LaunchConfig, kw, server=local) == launch and kw == {}


def test_a_launchs_workers_get_every_worker_setting_of_the_launch():
    launch = LaunchConfig(
        server=ServerConfig(),
        device="cpu",
        threads=3,
        data_dir="/d",
        step_delay=0.5,
        overlap="off",
        shm="payloads",
        wire="grpc",
        compress="bf16",
        push_every=3,
        cache_rows=7,
        amp="bf16",
        inner_optimizer="adamw",
        inner_lr=0.01,
    )
    worker = launch.worker("127.0.0.1:9", "worker-1")
    shared = [f.name for f, _ in settings.declared(LaunchConfig) if hasattr(worker, f.name)]
    assert len(shared) == 13
    assert all(getattr(worker, name) == getattr(launch, name) for name in shared)
    assert (worker.server, worker.name) == ("127.0.0.1:9", "worker-1")


def test_the_trainer_hands_the_worker_every_setting_it_takes():
    import inspect

    import torch

    from paramserver.training.trainer import worker_arguments
    from paramserver.worker.worker import Worker

    cfg = WorkerConfig(
        "127.0.0.1:1",
        name="w",
        rpc_timeout=7.0,
        barrier_timeout=8.0,
        server_timeout=9.0,
        compress="bf16",
        push_every=3,
        cache_rows=11,
        shm="payloads",
        overlap="off",
    )
    got = worker_arguments(cfg, torch.device("cpu"))
    takes = inspect.signature(Worker).parameters
    assert set(got) <= set(takes)
    for f in dataclasses.fields(WorkerConfig):
        if f.name in takes and f.name not in ("device", "overlap", "shm"):
            assert got[f.name] == getattr(cfg, f.name), f.name
    assert (got["overlap"], got["shm"], got["shm_control"]) == (False, True, False)
    # the first connection waits --server-timeout, as its help says
    assert got["connect_timeout"] == 9.0 and got["device"] == torch.device("cpu")


def test_no_option_of_the_command_line_is_written_by_hand():
    """Every option of the group and of every command derives from a declared setting;
    the rest are click's --help and --version and the positional arguments."""
    import click

    def hand_written(command: click.Command) -> list[str]:
        return [
            p.opts[0]
            for p in command.params
            if isinstance(p, click.Option)
            and not isinstance(p, settings.SettingOption)
            and p.opts[0] not in ("--help", "--version", "-h")
        ]

    assert hand_written(cli.cli) == []
    commands = dict(cli.cli.commands)
    for group in [c for c in commands.values() if isinstance(c, click.Group)]:
        assert hand_written(group) == [], group.name  # ``checkpoint``: its subcommands'
        commands.pop(str(group.name))
        commands.update({f"{group.name} {n}": c for n, c in group.commands.items()})
    for name, command in commands.items():
        assert hand_written(command) == [], name
        assert {"--config", "--print-config"} <= {p.opts[0] for p in command.params}, name
