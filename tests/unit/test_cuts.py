"""Consistent cuts of a sharded sync run: written at the same rounds on every shard, the
newest kept, resumed from, and rewound to; what cannot be done says why."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from torch import nn

from paramserver import checkpoint
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.errors import ConfigError, OutOfOrder, Timeout, WrongIncarnation
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


def test_a_shard_must_cut_by_iterations_not_seconds(tmp_path):
    for policy in ("sync", "async"):
        with pytest.raises(ConfigError, match="--checkpoint-every a number"):
            ServerConfig(policy=policy, shard=1, shards=2, checkpoint_dir=str(tmp_path))
    ServerConfig(policy="sync", checkpoint_dir=str(tmp_path))  # unsharded: seconds are fine


def test_under_async_every_worker_meets_at_the_cut_and_it_is_taken_there(tmp_path):
    nn.init.zeros_((model := nn.Linear(4, 1, bias=False)).weight)
    config = ServerConfig(
        policy="async", workers=2, shard=0, shards=2, checkpoint_dir=str(tmp_path),
        checkpoint_every="2", optimizer=OptimizerConfig("sgd", lr=1.0),
    )  # fmt: skip
    c = build_coordinator(config, model, now=FakeClock())
    saver = Checkpointer(c, tmp_path, "2", cuts=True).start()
    a, b = c.join("a"), c.join("b")
    ones = np.ones(2, np.float32)
    for t in range(2):
        c.pull(a.worker_id, t, 0.0)
        c.push(a.worker_id, t, ones, 1, 0.0)
    with pytest.raises(Timeout):  # a may not compute past the cut before b reaches it
        c.pull(a.worker_id, 2, 0.0)
    c.push(b.worker_id, 0, ones, 1, 0.0)
    assert not c.cuts_pending
    c.push(b.worker_id, 1, ones, 1, 0.0)  # every clock is 2 now: the cut
    assert c.cuts.last == 2 and c.cuts_pending
    c.pull(a.worker_id, 2, 0.0)  # and a goes on
    saver.write_cuts()
    state = checkpoint.load(tmp_path / checkpoint.cut_file(0, 2, 2))
    assert state["version"] == 4 and {m["clock"] for m in state["members"]} == {2}
    saver.stop()


def test_the_cut_schedule_as_pure_decisions():
    from paramserver.server.cuts import Cuts

    sync = Cuts(every=5, synchronous=True)
    assert [sync.after_round(r) for r in (4, 5, 6, 10)] == [None, 5, None, 10]
    assert sync.next is None and not sync.holds(100, 0)
    free = Cuts(every=5)
    assert free.next == 5 and free.reached(4) is None and free.reached(5) == 5
    assert free.holds(5, 4) and free.holds(7, 4) and not free.holds(4, 0)
    free.take(5, {"cut": 5})
    assert free.next == 10 and not free.holds(7, 5) and free.drain() == [{"cut": 5}]
    assert Cuts().next is None and not Cuts().holds(3, 0)  # a server that does not cut
