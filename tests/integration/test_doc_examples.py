"""Every ```python block of README.md and docs/*.md runs as written, or says that it is a
fragment: its first line is a ``# fragment: ...`` comment naming what it needs; and every
``paramserver ...`` command of their shell blocks parses (its command and options exist).

Each complete block runs as a user would paste it: ``python -c`` in a fresh process, in an
empty folder, with a deadline; the examples themselves are short (a few seconds each).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from paramserver.errors import DataUnavailable
from paramserver.training import data

ROOT = Path(__file__).resolve().parents[2]
PYTHON = {"python", "py", "python3"}
FRAGMENT = "# fragment:"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\s`]*)")
FASHION = re.compile(r"""load\(\s*["']fashion-mnist["']""")
DEADLINE = 120.0  # seconds one example may take before it fails (each takes about 10)


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it starts (the fence's line, 1-based) and its code."""

    where: str
    lang: str
    code: str

    @property
    def fragment(self) -> bool:
        lines = [line for line in self.code.splitlines() if line.strip()]
        return bool(lines) and lines[0].lstrip().startswith(FRAGMENT)


def fenced_blocks(text: str, name: str) -> list[Block]:
    """Every fenced block of a Markdown text (``` or ~~~, indented or not), in order."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            j += 1
        lang = opening["info"].lower()
        blocks.append(Block(f"{name}:{i + 1}", lang, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def python_blocks() -> list[Block]:
    """The python blocks of README.md and of every page in docs/."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        blocks = fenced_blocks(text, str(page.relative_to(ROOT)))
        found += [b for b in blocks if b.lang in PYTHON]
    return found


BLOCKS = python_blocks()
COMPLETE = [b for b in BLOCKS if not b.fragment]


def fashion_mnist_absent() -> bool:
    try:
        data.train_size("fashion-mnist")
    except DataUnavailable:
        return True
    return False


def test_blocks_are_found_by_language_and_fragments_by_their_first_line():
    text = (
        "Text.\n\n```python\nprint(1)\n```\n\n```\npython -c 'x'\n```\n\n```sh\nls\n```\n"
        "- a list item:\n\n  ~~~py\n  # fragment: needs `model`\n  model.eval()\n  ~~~\n"
        "````python\n```\nstill inside\n````\n"
    )
    blocks = [b for b in fenced_blocks(text, "t.md") if b.lang in PYTHON]
    assert [(b.where, b.code, b.fragment) for b in blocks] == [
        ("t.md:3", "print(1)\n", False),
        ("t.md:16", "# fragment: needs `model`\nmodel.eval()\n", True),
        ("t.md:20", "```\nstill inside\n", False),
    ]


def test_the_documented_examples_are_complete_programs():
    """The README's and the API page's examples are found, and are not fragments."""
    pages = {b.where.split(":")[0] for b in COMPLETE}
    assert {"README.md", "docs/api.md"} <= pages, [b.where for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_every_python_block_compiles_and_a_fragment_says_what_it_needs(block: Block):
    compile(block.code, block.where, "exec")
    if block.fragment:
        first = next(line for line in block.code.splitlines() if line.strip())
        assert first.split(FRAGMENT, 1)[1].strip(), f"{block.where}: '{FRAGMENT}' names nothing"


@pytest.mark.parametrize("block", COMPLETE, ids=[b.where for b in COMPLETE])
def test_a_complete_example_runs_as_written(block: Block, tmp_path: Path):
    """Pasted into ``python`` in an empty folder, it exits 0 within the deadline (on timeout,
    subprocess.run kills the child before raising)."""
    if FASHION.search(block.code) and fashion_mnist_absent():
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    done = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{done.stderr[-4000:]}"


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every ``paramserver ...`` command line of a shell block (not python, toml, yaml or
    json) in README.md and docs/: (where, its words after ``paramserver``), with a
    continued line joined, a leading ``$ `` and variable assignments dropped, and a ``...``
    (the doc's "and the rest") left out."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for page in pages:
        for block in fenced_blocks(page.read_text(encoding="utf-8"), page.name):
            if block.lang in PYTHON | {"toml", "yaml", "json"}:
                continue
            for line in block.code.replace("\\\n", " ").splitlines():
                words = _words(line.strip().removeprefix("$ "))
                while words and re.match(r"^[A-Z_]+=", words[0]):
                    words = words[1:]
                if words and words[0] in ("paramserver", ".venv/bin/paramserver"):
                    found.append((block.where, [w for w in words[1:] if w != "..."]))
    return found


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # prose in a block (an unclosed quote): not a command
        return []


COMMANDS = documented_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 20, COMMANDS


@pytest.mark.parametrize("where,words", COMMANDS, ids=[f"{w}:{' '.join(c)}" for w, c in COMMANDS])
def test_every_documented_command_parses(where, words, tmp_path, monkeypatch):
    """Each documented command names a command and options that exist, with values they
    take (a renamed option or a wrong spelling fails here); nothing is run. Files it names
    for --config and TLS are made empty in a scratch folder."""
    from paramserver import cli

    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("PARAMSERVER_")]:
        monkeypatch.delenv(name)
    for flag, value in zip(words, words[1:], strict=False):
        if flag in ("--config", "--tls-cert", "--tls-key", "--tls-ca"):
            (tmp_path / value).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / value).write_text("")
    group, rest = cli.cli, list(words)
    while rest and rest[0].startswith("--"):  # the group's own options before the command
        rest = rest[2:]
    assert rest and rest[0] in group.commands, f"{where}: no command in {words}"
    command = group.commands[rest[0]]
    try:
        command.make_context(rest[0], rest[1:])
    except click.ClickException as exc:
        pytest.fail(f"{where}: paramserver {' '.join(words)}: {exc.format_message()}")


def test_the_guides_print_config_sample_is_what_the_command_prints(tmp_path: Path):
    """Every line of guide.md's --print-config sample (but its "..." elisions) is in the real
    output, in order (issue 46)."""
    guide = (ROOT / "docs" / "guide.md").read_text()
    block = guide.split("$ PARAMSERVER_WORKERS=4 paramserver server --config run.toml", 1)[1]
    sample = block.split("```", 1)[0].splitlines()[1:]
    (tmp_path / "run.toml").write_text(
        '[server]\npolicy = "ssp:2"\ncheckpoint-dir = "/var/lib/paramserver"\n'
    )
    out = subprocess.run(
        [sys.executable, "-m", "paramserver", "server", "--config", "run.toml"]
        + ["--epochs", "3", "--print-config"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PARAMSERVER_WORKERS": "4"},
    )
    assert out.returncode == 0, out.stderr
    printed = iter(out.stdout.splitlines())
    for line in (ln for ln in sample if ln.strip() and ln.strip() != "..."):
        assert any(p == line for p in printed), f"guide.md's line not printed (in order): {line!r}"


def _readme_daemon_walk() -> list[list[str]]:
    """README's "Daemons on several hosts" commands (server, worker, status), as words."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = next(b for b in fenced_blocks(readme, "README.md") if "paramserver worker" in b.code)
    lines = block.code.replace("\\\n", " ").splitlines()
    return [_words(line)[1:] for line in lines if line.strip().startswith("paramserver ")]


def _on_this_host(words: list[str], values: dict[str, str]) -> list[str]:
    """``words`` with the options in ``values`` replaced (added where missing), and none
    of ``--watch`` (it never ends)."""
    out, rest = [], list(words)
    while rest:
        word = rest.pop(0)
        if word == "--watch" or word in values:
            rest.pop(0)
        else:
            out.append(word)
    for flag, value in values.items():
        out += [flag, value]
    return out


def test_the_readme_daemon_walk_runs_and_reports(tmp_path: Path, children):
    """README's daemon commands as a user runs them on one host (issue 46 item 9): the
    server, ``worker --procs 2``, ``status``; then the run folder the server wrote. Only
    what must differ here is changed: addresses, the folders, a small data set, one epoch."""
    from tests.conftest import DEADLINE as WAIT
    from tests.conftest import paramserver_cmd, wait_until

    server, worker, status = _readme_daemon_walk()
    assert (server[0], worker[0], status[0]) == ("server", "worker", "status")
    assert "--procs" in worker and "--checkpoint-dir" in server
    ckpt = tmp_path / "ckpt"
    server = _on_this_host(
        server,
        {
            "--host": "127.0.0.1",
            "--port": "0",
            "--checkpoint-dir": str(ckpt),
            "--dataset": "synthetic",
            "--epochs": "2",
            "--workers": "2",
        },
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMSERVER_")}
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen(
            paramserver_cmd(*server),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
    children.append(proc)
    assert proc.stdout is not None
    ready = proc.stdout.readline()  # the server prints it once it serves (or exits)
    assert "listening on" in ready, (tmp_path / "server.log").read_text()[-3000:]
    address = ready.split()[-1]
    worker = _on_this_host(worker, {"--server": address, "--device": "cpu"})
    done = subprocess.run(
        paramserver_cmd(*worker),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=WAIT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (
        "[rank 0]" in done.stdout + done.stderr and "2 done, 0 failed" in done.stdout + done.stderr
    )
    run = ckpt / "run"
    wait_until(lambda: (run / "summary.json").exists(), "the server's summary.json written")
    shown = subprocess.run(
        paramserver_cmd(*_on_this_host(status, {"--server": address})),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=WAIT,
    )
    assert shown.returncode == 0, shown.stderr
    assert "test after epoch 2: accuracy" in shown.stdout, shown.stdout
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [1, 2]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_accuracy"] == metrics[-1]["test_accuracy"] > 0.5
    assert (run / "curve.png").stat().st_size > 1000 and (run / "config.json").exists()
    proc.terminate()
    assert proc.wait(timeout=WAIT) == 0
