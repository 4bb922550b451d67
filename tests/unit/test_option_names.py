"""One setting, one name (issue 30, must 5): a global option works after the command too,
a setting has the same option on every command that takes it, and an environment variable
names one setting; where defaults differ between commands, the help says why."""

from __future__ import annotations

import logging
from collections import defaultdict

import click
import pytest

from paramserver import cli
from paramserver.settings import SettingOption

# Variables that two declarations share on purpose: the same thing, asked by several
# commands (the address of the server; the model and seed of the run that export reads).
SHARED = {
    "PARAMSERVER_SERVER": "the servers' addresses, comma-separated: a worker dials each, "
    "status and health the first",
    "PARAMSERVER_MODEL": "the run's model: export rebuilds the run's",
    "PARAMSERVER_SEED": "the run's seed: export rebuilds the run's frozen parameters",
}


def _options() -> list[tuple[str, SettingOption]]:
    """(command, option) for every setting option of every command."""
    out = []
    for name, command in cli.cli.commands.items():
        for param in command.params:
            if isinstance(param, SettingOption):
                out.append((name, param))
    return out


def test_a_setting_has_one_option_name_on_every_command():
    names = defaultdict(set)
    for _command, param in _options():
        names[id(param.setting)].add(param.opts[0])
    assert all(len(found) == 1 for found in names.values()), names


def test_an_environment_variable_names_one_setting():
    used = defaultdict(set)
    for _command, param in _options():
        used[param.envvar].add((id(param.setting), param.opts[0]))
    shared = {env: uses for env, uses in used.items() if len(uses) > 1}
    assert set(shared) <= set(SHARED), sorted(set(shared) - set(SHARED))
    for env in ("PARAMSERVER_JSON", "PARAMSERVER_TIMEOUT"):
        assert env not in used
    for env, command, option in [
        ("PARAMSERVER_STATUS_JSON", "status", "--json"),
        ("PARAMSERVER_LAUNCH_JSON", "launch", "--json"),
        ("PARAMSERVER_BENCH_JSON", "bench", "--json"),
        ("PARAMSERVER_STATUS_RPC_TIMEOUT", "status", "--rpc-timeout"),
        ("PARAMSERVER_HEALTH_RPC_TIMEOUT", "health", "--rpc-timeout"),
        ("PARAMSERVER_SERVER_THREADS", "server", "--server-threads"),
        ("PARAMSERVER_SERVER_THREADS", "launch", "--server-threads"),
    ]:
        params = {p.opts[0]: p for p in cli.cli.commands[command].params}
        assert params[option].envvar == env


def test_the_call_deadline_and_the_optimizer_threads_have_one_name():
    for command in ("worker", "status", "health"):
        opts = {o for p in cli.cli.commands[command].params for o in p.opts}
        assert "--rpc-timeout" in opts and "--timeout" not in opts
    for command in ("server", "launch"):
        opts = {o for p in cli.cli.commands[command].params for o in p.opts}
        assert "--server-threads" in opts
    server = {o for p in cli.cli.commands["server"].params for o in p.opts}
    assert "--threads" not in server


@pytest.mark.parametrize("command", sorted(cli.cli.commands))
def test_the_log_level_works_after_the_command(capsys, command):
    args = {
        "plot": ["."],
        "export": [".", "--model", "mlp"],
        "checkpoint": ["reshard", ".", "--model", "mlp", "--shards", "2"],
        "bench": ["transport"],
        "worker": ["--server", "127.0.0.1:1"],
    }
    argv = [command, *args.get(command, []), "--log-level", "debug", "--print-config"]
    root = logging.getLogger()
    before = root.level
    try:
        cli.cli.main(args=argv, prog_name="paramserver", standalone_mode=False)
        assert root.level == logging.DEBUG
    finally:
        root.setLevel(before)
    printed = capsys.readouterr().out
    assert 'log-level = "debug"' in printed and "# command line" in printed.splitlines()[1]


def test_the_log_level_after_the_command_is_checked():
    with pytest.raises(click.BadParameter, match="loud"):
        cli.cli.main(
            args=["status", "--log-level", "loud"], prog_name="paramserver", standalone_mode=False
        )


def test_where_launch_and_server_defaults_differ_the_help_says_why():
    def schedule(command: str) -> click.Option:
        return next(p for p in cli.cli.commands[command].params if p.name == "lr_schedule")

    assert schedule("server").default == "constant"
    assert schedule("launch").default == "cosine"
    for command in ("server", "launch"):
        text = schedule(command).help or ""
        assert "constant on server" in text and "cosine over the whole run on launch" in text
        assert "--push-every" in text


def test_the_launch_summary_counts_in_words():
    from paramserver.cli.run import _count

    assert (_count(1, "epoch"), _count(2, "epoch"), _count(1, "worker")) == (
        "1 epoch",
        "2 epochs",
        "1 worker",
    )


def test_status_shows_no_loss_before_the_first_push():
    import math

    from paramserver._proto import paramserver_pb2 as pb
    from paramserver.cli.statusview import render

    before = render(pb.StatusResponse(train_loss=math.nan), "h:1")
    assert "loss -  " in before and "nan" not in before
    assert "loss 0.2500" in render(pb.StatusResponse(train_loss=0.25), "h:1")


def test_the_curve_has_whole_epochs_on_its_axes(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from paramserver.cluster.rundir import RunDir

    run = RunDir(tmp_path, "x")
    for epoch in (1, 2, 3):
        run.append_metrics(
            {"epoch": epoch, "test_accuracy": 0.5, "test_loss": 1.0, "samples": 100 * epoch}
            | {"wall_s": float(epoch), "train_loss": 1.1}
        )
    drawn = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (drawn.append(fig), close(fig)))
    run.plot()
    ticks = [t for ax in drawn[0].axes for t in ax.get_xticks()]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
