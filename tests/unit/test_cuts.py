"""Consistent cuts of a sharded sync run: written at the same rounds on every shard, the
newest kept, resumed from, and rewound to; what cannot be done says why."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from torch import nn

from paramserver import checkpoint
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.errors import ConfigError, OutOfOrder, WrongIncarnation
from paramserver.server.app import build_coordinator
from paramserver.server.checkpointer import Checkpointer
from tests.conftest import DEADLINE, FakeClock


def _shard(tmp_path, every: str = "2"):
    nn.init.zeros_((model := nn.Linear(4, 1, bias=False)).weight)
    config = ServerConfig(
        policy="sync", workers=1, shard=0, shards=2, checkpoint_dir=str(tmp_path),
        checkpoint_every=every, optimizer=OptimizerConfig("sgd", lr=1.0),
    )  # fmt: skip
    coordinator = build_coordinator(config, model, now=FakeClock())
    return coordinator, Checkpointer(coordinator, tmp_path, every, cuts=True)


def _rounds(c, member, n: int) -> None:
    for _ in range(n):
        clock = c.membership.get(member.worker_id).clock
        c.push(member.worker_id, clock, np.ones(c.manifest.numel, np.float32), 1, 0.0)


def test_cuts_are_taken_at_every_nth_round_and_the_newest_are_kept(tmp_path):
    c, saver = _shard(tmp_path)
    saver.start()  # a fresh shard cuts round 0: where a rewind to the start goes
    assert sorted(checkpoint.list_cuts(tmp_path, 0, 2)) == [0]
    a = c.join("a")
    _rounds(c, a, 7)
    saver.stop()
    assert sorted(checkpoint.list_cuts(tmp_path, 0, 2)) == [2, 4, 6]
    state = checkpoint.load(tmp_path / checkpoint.cut_file(0, 2, 4))
    assert state["rounds"] == state["version"] == 4
    assert state["members"][0]["clock"] == 4
    np.testing.assert_array_equal(state["model_state_dict"]["flat"].numpy(), np.full(2, -4.0))

    again, saver2 = _shard(tmp_path)
    saver2.resume()  # the newest cut, not the later checkpoint file
    assert again.rounds == 6


def test_a_rewind_reloads_the_cut_as_a_new_incarnation(tmp_path):
    c, saver = _shard(tmp_path)
    saver.start()
    a = c.join("a")
    _rounds(c, a, 5)
    saver.write_cuts()
    was = c.incarnation
    with pytest.raises(WrongIncarnation):
        saver.rewind(2, "another")
    with pytest.raises(OutOfOrder, match=r"keeps cuts at rounds \[0, 2, 4\], not at round 3"):
        saver.rewind(3, was)
    # a pull waiting for the next round when the rewind comes is refused, not left hanging
    waiting = {}

    def pull() -> None:
        try:
            c.pull(a.worker_id, 6, DEADLINE, incarnation=was)
        except WrongIncarnation as exc:
            waiting["error"] = exc

    puller = threading.Thread(target=pull)
    puller.start()
    saver.rewind(2, was)
    puller.join(DEADLINE)
    assert "error" in waiting
    assert c.incarnation != was and c.rounds == 2 and c.store.version == 2
    assert sorted(checkpoint.list_cuts(tmp_path, 0, 2)) == [0, 2]  # 4 was of the rounds undone
    np.testing.assert_array_equal(c.store.weights, np.full(2, -2.0))
    assert c.membership.get(a.worker_id).clock == 2
    with pytest.raises(WrongIncarnation):
        c.push(a.worker_id, 2, np.ones(2, np.float32), 1, 0.0, incarnation=was)
    saver.stop()


def test_a_sharded_sync_server_must_cut_by_steps_not_seconds(tmp_path):
    with pytest.raises(ConfigError, match="--checkpoint-every a number of steps"):
        ServerConfig(policy="sync", shard=1, shards=2, checkpoint_dir=str(tmp_path))
    # elsewhere seconds are fine: unsharded, or not sync
    ServerConfig(policy="sync", checkpoint_dir=str(tmp_path))
    ServerConfig(policy="async", shard=1, shards=2, checkpoint_dir=str(tmp_path))
