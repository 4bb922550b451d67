"""One config, four doors: defaults, a TOML file (``--config``), ``PARAMSERVER_*`` variables
and the command line, in rising precedence, for every command; a file's mistakes name the
file, the key and the value; ``--print-config`` says where each value came from."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from paramserver import cli
from paramserver.cli import configfile


@pytest.fixture(autouse=True)
def _no_settings_in_the_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("PARAMSERVER_"):
            monkeypatch.delenv(name)


def run(capsys, *args: str) -> tuple[int, str, str]:
    """``paramserver ARGS`` in this process: exit status, stdout, stderr."""
    try:
        cli.main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def printed(capsys, *args: str) -> dict[str, tuple[str, str]]:
    """``--print-config``'s lines: {key: (value as written, source)}."""
    code, out, err = run(capsys, *args, "--print-config")
    assert code == 0, err
    found = {}
    for line in out.splitlines():
        m = re.match(r"^(# )?([\w-]+)(?: = |: )(.*?)\s+# (.+)$", line)
        if m:
            found[m[2]] = (m[3], m[4])
    return found


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "paramserver.toml"
    path.write_text(text)
    return str(path)


# One option of each command: (command, its other arguments, key, variable, then the value
# the file, the variable and the command line give, as TOML and as the option reads them).
PRECEDENCE = [
    ("server", [], "policy", "PARAMSERVER_POLICY", ('"ssp:2"', "async", "sync")),
    (
        "worker",
        ["--server", "127.0.0.1:1"],
        "push-every",
        "PARAMSERVER_PUSH_EVERY",
        ("2", "3", "4"),
    ),
    ("launch", ["--dataset", "synthetic"], "epochs", "PARAMSERVER_EPOCHS", ("2", "3", "4")),
    ("status", [], "rpc-timeout", "PARAMSERVER_STATUS_RPC_TIMEOUT", ("1.5", "2.5", "3.5")),
    ("health", [], "service", "PARAMSERVER_HEALTH_SERVICE", ('"a"', "b", "c")),
    ("plot", ["{tmp}"], "out", "PARAMSERVER_PLOT_OUT", ('"a.png"', "b.png", "c.png")),
    ("export", ["{tmp}", "--model", "mlp"], "seed", "PARAMSERVER_SEED", ("1", "2", "3")),
]


@pytest.mark.parametrize("command,args,key,variable,given", PRECEDENCE)
def test_the_command_line_beats_the_variable_beats_the_file_beats_the_default(
    capsys, monkeypatch, tmp_path, command, args, key, variable, given
):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    in_file, in_env, on_line = given
    default = printed(capsys, command, *args)[key]
    assert default[1] == "default"
    path = write(tmp_path, f"[{command}]\n{key} = {in_file}\n")
    base = [command, *args, "--config", path]
    assert printed(capsys, *base)[key] == (in_file, f"file {path}")
    monkeypatch.setenv(variable, in_env)
    value, source = printed(capsys, *base)[key]
    assert source == f"env {variable}" and value.strip('"') == in_env
    value, source = printed(capsys, *base, f"--{key}", on_line)[key]
    assert source == "command line" and value.strip('"') == on_line


def test_a_switch_follows_the_same_order(capsys, monkeypatch, tmp_path):
    assert printed(capsys, "bench", "step")["quick"] == ("false", "default")
    path = write(tmp_path, "[bench]\nquick = true\n")
    assert printed(capsys, "bench", "step", "--config", path)["quick"] == ("true", f"file {path}")
    monkeypatch.setenv("PARAMSERVER_BENCH_QUICK", "false")
    assert printed(capsys, "bench", "step", "--config", path)["quick"] == (
        "false",
        "env PARAMSERVER_BENCH_QUICK",
    )
    got = printed(capsys, "bench", "step", "--config", path, "--quick")["quick"]
    assert got == ("true", "command line")


def test_the_file_can_come_from_its_variable_and_keys_may_use_underscores(
    capsys, monkeypatch, tmp_path
):
    path = write(tmp_path, '[server]\ncheckpoint_dir = "/ckpt"\nlr = 1\n')
    monkeypatch.setenv("PARAMSERVER_CONFIG", path)
    got = printed(capsys, "server")
    assert got["checkpoint-dir"] == ('"/ckpt"', f"file {path}")
    assert got["lr"] == ("1.0", f"file {path}")  # read as the option reads it: a float


def test_print_config_names_every_source_and_hides_the_token(capsys, monkeypatch, tmp_path):
    path = write(tmp_path, 'log-level = "warning"\n[server]\nlr = 0.01\n[worker]\nshm = "off"\n')
    monkeypatch.setenv("PARAMSERVER_WORKERS", "4")
    monkeypatch.setenv("PARAMSERVER_TOKEN", "s3cret")
    code, out, err = run(
        capsys, "server", "--config", path, "--epochs", "3", "--model", "resnet", "--print-config"
    )
    assert code == 0, err
    assert "s3cret" not in out
    lines = out.splitlines()
    assert lines[1].startswith('log-level = "warning"') and lines[1].endswith(f"# file {path}")
    for expected in (
        ("epochs = 3", "command line"),
        ("workers = 4", "env PARAMSERVER_WORKERS"),
        ("lr = 0.01", f"file {path}"),  # beats resnet's own default
        ('policy = "delay-1"', "default"),
        ("# token: set, not shown", "env PARAMSERVER_TOKEN"),
        ("# min-workers: unset", "default"),
    ):
        assert any(
            ln.startswith(expected[0]) and ln.endswith("# " + expected[1]) for ln in lines
        ), (expected, out)
    # a built-in model's defaults say so
    got = printed(capsys, "server", "--model", "dlrm")
    assert got["dataset"] == ('"clicks"', "model dlrm") and got["epochs"][1] == "model dlrm"


def test_print_config_is_a_config_file_that_gives_the_same_settings(capsys, tmp_path):
    args = [
        "server",
        "--policy",
        "ssp:3",
        "--workers",
        "5",
        "--lr",
        "0.05",
        "--shard",
        "1/2",
        "--checkpoint-dir",
        str(tmp_path),
        "--checkpoint-every",
        "200",
        "--skip-nonfinite",
        "--port",
        "0",
    ]
    code, out, err = run(capsys, *args, "--print-config")
    assert code == 0, err
    path = write(tmp_path, out)
    again = printed(capsys, "server", "--config", path)
    first = printed(capsys, *args)
    assert {k: v for k, (v, _) in again.items()} == {k: v for k, (v, _) in first.items()}
    assert {s for _, s in again.values()} <= {f"file {path}", "default"}


def test_print_config_starts_nothing(capsys, monkeypatch, tmp_path):
    import paramserver.cluster.launch
    import paramserver.server.app

    def refuse(*args, **kwargs):
        raise AssertionError("started")

    monkeypatch.setattr(paramserver.server.app.ServerApp, "start", refuse)
    monkeypatch.setattr(paramserver.cluster.launch, "launch", refuse)
    assert run(capsys, "server", "--print-config")[0] == 0
    assert run(capsys, "launch", "--dataset", "synthetic", "--print-config")[0] == 0
    # launch shows the schedule's length it works out for the run
    got = printed(capsys, "launch", "--dataset", "synthetic", "--epochs", "2", "--workers", "1")
    assert got["lr-total-steps"] == (str(2 * 4096 // 64), "launch: the run's optimizer steps")


def test_launch_takes_its_settings_from_the_file(capsys, monkeypatch, tmp_path):
    import paramserver.cluster.launch

    seen = []

    def fake_launch(cfg):
        seen.append(cfg)
        return {"failed_workers": [], "ok": True}

    monkeypatch.setattr(paramserver.cluster.launch, "launch", fake_launch)
    path = write(
        tmp_path,
        """
        [launch]
        dataset = "synthetic"
        policy = "sync"
        workers = 3
        epochs = 2
        lr-schedule = "constant"
        device = "cpu"
        servers = 2
        server-threads = 2
        push-every = 2
        progress = false
        json = true
        [server]
        policy = "async"   # another command's table: not launch's
    """.replace("\n        ", "\n"),
    )
    code, out, err = run(capsys, "launch", "--config", path, "--epochs", "3")
    assert code == 0, err
    (cfg,) = seen
    assert (cfg.server.policy, cfg.server.workers, cfg.server.epochs) == ("sync", 3, 3)
    assert (cfg.server.dataset, cfg.server.threads, cfg.server.optimizer.schedule) == (
        "synthetic",
        2,
        "constant",
    )
    assert (cfg.device, cfg.servers, cfg.push_every, cfg.progress) == ("cpu", 2, 2, False)
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 0)
    assert out.strip() == '{"failed_workers": [], "ok": true}'  # json = true


BAD = [
    (
        '[server]\npolcy = "sync"\n',
        "server",
        '[server] polcy = "sync": unknown key',
        "did you mean policy?",
    ),
    (
        '[srever]\npolicy = "sync"\n',
        "server",
        '[srever] = {policy = "sync"}: unknown table',
        "[server]",
    ),
    (
        '[server]\nworkers = "many"\n',
        "server",
        '[server] workers = "many"',
        "is not a valid integer",
    ),
    ("[server]\nworkers = 2.5\n", "server", "[server] workers = 2.5", "not a valid integer"),
    (
        '[server]\noptimizer = "lbfgs"\n',
        "server",
        '[server] optimizer = "lbfgs"',
        "Unknown optimizer",
    ),
    (
        "[server]\nskip-nonfinite = 1\n",
        "server",
        "[server] skip-nonfinite = 1",
        "takes true or false",
    ),
    ("[server]\nlr = [1, 2]\n", "server", "[server] lr = [1, 2]", "takes one value"),
    ('[worker]\nshm = "maybe"\n', "status", '[worker] shm = "maybe"', "is not one of"),
    (
        'log-levle = "debug"\n',
        "status",
        'log-levle = "debug": unknown key',
        "did you mean log-level?",
    ),
    (
        "[server]\nworkers = 0\n",
        "server",
        "[server] workers = 0",
        "--workers must be at least 1; got 0",
    ),
    (
        '[server]\npolicy = "never"\n',
        "server",
        '[server] policy = "never"',
        "Unknown staleness policy (--policy) 'never'",
    ),
    (
        '[worker]\ndevice = "tpu"\n',
        "worker",
        '[worker] device = "tpu"',
        "--device must be auto, cpu, cuda or cuda:N",
    ),
    ("[server]\nmodel = \n", "server", "is not TOML", ""),
]


@pytest.mark.parametrize("text,command,names,why", BAD)
def test_a_mistake_in_the_file_is_a_usage_error_naming_the_file_the_key_and_the_value(
    capsys, tmp_path, text, command, names, why
):
    path = write(tmp_path, text)
    args = ["--server", "127.0.0.1:1"] if command == "worker" else []
    code, out, err = run(capsys, command, *args, "--config", path, "--print-config")
    assert code == 2, out + err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"paramserver: error: {path}: ") and names in err and why in err, err
    assert out == ""


def test_a_refusal_names_the_file_only_where_it_names_a_value_from_the_file(capsys, tmp_path):
    path = write(tmp_path, "[server]\nworkers = 3\n")
    # the file's --workers is a party to the conflict
    code, _, err = run(capsys, "server", "--config", path, "--min-workers", "4", "--print-config")
    assert code == 2
    assert err.startswith(f"paramserver: error: {path}: [server] workers = 3: --min-workers")
    # the command line's --lr alone is refused: the file is not to blame
    code, _, err = run(capsys, "server", "--config", path, "--lr", "-1", "--print-config")
    assert code == 2 and path not in err and "learning rate (--lr) must be a positive" in err


def test_the_files_log_level_applies_unless_given(capsys, tmp_path):
    root = logging.getLogger()
    before = root.level
    path = write(tmp_path, 'log-level = "error"\n')
    try:
        assert run(capsys, "status", "--config", path, "--print-config")[0] == 0
        assert root.level == logging.ERROR
        out = run(capsys, "--log-level", "debug", "status", "--config", path, "--print-config")[1]
        assert re.search(r'^log-level = "debug"\s+# command line$', out, re.M), out
    finally:
        root.setLevel(before)


def test_an_empty_config_variable_reads_no_file(monkeypatch):
    """What a launch's children get (``CHILD_ENV``): their argv is all their settings."""
    from paramserver.cluster.commands import CHILD_ENV

    monkeypatch.setenv("PARAMSERVER_CONFIG", CHILD_ENV["PARAMSERVER_CONFIG"])
    ctx = cli.cli.commands["server"].make_context("server", [])
    assert ctx.params["policy"] == "delay-1" and ctx.default_map is None


def test_toml_values_are_written_back_as_toml():
    import tomllib

    for value in ('a "quoted" \\ line\n', 3, 0.001, 1e-300, True, [1, "x"], {"k": 1.5}):
        assert tomllib.loads(f"v = {configfile.toml(value)}")["v"] == value


@pytest.mark.parametrize("command", ["server", "worker", "status", "health"])
def test_the_example_file_in_deploy_gives_each_of_its_commands_its_table(capsys, command):
    path = str(Path(__file__).resolve().parents[2] / "deploy" / "paramserver.example.toml")
    got = printed(capsys, command, "--config", path)
    table = tomllib_load(path)[command]
    for key, value in table.items():
        assert got[key] == (configfile.toml(value), f"file {path}"), key


def tomllib_load(path: str) -> dict:
    import tomllib

    with open(path, "rb") as f:
        return tomllib.load(f)


HOSTILE = [
    (b'[server]\nmodel = "\xff\xfe"\n', "is not UTF-8 text (byte 0xff at offset 18)"),
    (b"[server]\nlr = " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "nest too deep"),
    (b"# " + b"x" * ((1 << 20) + 1) + b"\n", "is larger than 1 MiB"),
    (b'[server]\npolicy = "' + b"a" * 500_000 + b'"\n', "... (500002 characters)"),
    (b"[server]\n" + b"k" * 500_000 + b" = 1\n", "characters)"),
    (b"[server]\nlr = inf\n", "lr = inf: inf is not a finite number"),
    (b"[server]\nlr = nan\n", "lr = nan: nan is not a finite number"),
    (
        b'[server]\nmodel = "os:system"\n',
        "model = \"os:system\": --model 'os:system' is not a model factory",
    ),
]


@pytest.mark.parametrize("content,why", HOSTILE, ids=lambda v: repr(v)[:30])
def test_a_hostile_file_is_refused_in_one_short_line(capsys, tmp_path, content, why):
    """Not UTF-8, nested 100,000 deep, over 1 MiB, a value or key of 500 kB, inf, a
    function that is no model factory: one line of at most a few hundred characters,
    exit 2, no traceback (they gave a 39-line traceback, a RecursionError of 3,000 lines,
    the 20 MiB value echoed whole, inf accepted, a TypeError)."""
    path = tmp_path / "paramserver.toml"
    path.write_bytes(content)
    printing = [] if b"os:system" in content else ["--print-config"]  # it builds the model
    code, out, err = run(capsys, "server", "--config", str(path), *printing)
    assert code == 2, out + err
    assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 1000, err[:2000]
    assert str(path) in err and why in err, err


@pytest.mark.parametrize(
    "args,why",
    [
        (["--lr", "inf"], "'inf' is not a finite number"),
        (["--lr", "-inf"], "'-inf' is not a finite number"),
        (["--lease-timeout", "inf"], "'inf' is not a finite number"),
        (["--model", "os:system"], "'os:system' is not a model factory"),
    ],
)
def test_the_command_line_refuses_the_same_values(capsys, args, why):
    printing = [] if "os:system" in args else ["--print-config"]  # it builds the model
    code, out, err = run(capsys, "server", "--port", "0", *args, *printing)
    assert code == 2, out + err
    assert err.count("\n") == 1 and "Traceback" not in err and why in err, err
