"""``make test``'s ``--dist loadgroup`` runs the tests of one ``xdist_group`` on one process,
one at a time (tests/conftest.py): the namespace tests share a subnet, the docker ones a
daemon, the benches the cores. With pytest 9.2 and pytest-xdist 3.8 the groups were silently
ignored (xdist writes the group into a field pytest no longer reads), and two chaos soaks
ran at once and fought over the bridge address. This runs a small suite on two processes
and checks that the grouped tests shared one."""

from __future__ import annotations

import subprocess
import sys

SUITE = """
import os, pytest

@pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    with open("workers.txt", "a") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("i", range(8))
def test_free(i):
    pass
"""


def test_a_group_runs_on_one_process(tmp_path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "/dev/null"]
        + ["--rootdir", str(tmp_path), "-n", "2", "--dist", "loadgroup", "test_suite.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    workers = (tmp_path / "workers.txt").read_text().split()
    assert len(workers) == 4 and len(set(workers)) == 1, workers
