"""How often a server that does not cut writes its checkpoint: ``--checkpoint-every N``
steps means N optimizer steps, not every wake of the writer's loop."""

from __future__ import annotations

import numpy as np
from torch import nn

from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.server.build import build_coordinator
from paramserver.server.disk import checkpoint
from paramserver.server.disk.checkpoint_writer import Checkpointer
from tests.conftest import FakeClock


def _server(tmp_path, every: str):
    config = ServerConfig(
        policy="async",
        workers=1,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=every,
        optimizer=OptimizerConfig("sgd", lr=0.1),
    )
    c = build_coordinator(config, nn.Linear(4, 1), now=FakeClock())
    return c, Checkpointer(c, tmp_path, every, cuts=False)


def _steps(c, member, n: int) -> None:
    for _ in range(n):
        clock = c.membership.get(member.worker_id).clock
        c.push(member.worker_id, clock, np.ones(c.manifest.numel, np.float32), 1, 0.0)


def _written(tmp_path) -> int | None:
    path = tmp_path / checkpoint.server_file(0, 1)
    return checkpoint.load(path)["version"] if path.exists() else None


def test_a_checkpoint_every_n_steps_is_written_only_when_n_steps_have_passed(tmp_path):
    """The writer's loop wakes at least once a second and called ``write_due``, which
    saved whenever the version had changed: --checkpoint-every 100000 wrote once a second."""
    c, saver = _server(tmp_path, "5")
    a = c.join("a")
    _steps(c, a, 4)
    assert not saver.checkpoint_due()
    assert saver.write_due() and _written(tmp_path) is None  # a wake 4 steps in: nothing
    _steps(c, a, 1)
    assert saver.write_due() and _written(tmp_path) == 5
    _steps(c, a, 3)
    assert saver.write_due() and _written(tmp_path) == 5
    _steps(c, a, 2)
    assert saver.write_due() and _written(tmp_path) == 10
    saver.stop()  # the last checkpoint, whatever the count
    assert _written(tmp_path) == 10


def test_a_checkpoint_every_n_seconds_is_written_at_each_wake_with_a_newer_version(tmp_path):
    c, saver = _server(tmp_path, "30s")
    a = c.join("a")
    assert not saver.checkpoint_due()  # nothing new
    _steps(c, a, 1)
    assert saver.write_due() and _written(tmp_path) == 1
    assert not saver.checkpoint_due()
