"""Consistent cuts of a sharded sync run: written at the same rounds on every shard, the
newest kept, resumed from, and rewound to; what cannot be done says why."""

from __future__ import annotations

import errno
import threading

import numpy as np
import pytest
from torch import nn

from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.errors import ConfigError, OutOfOrder, Timeout, WrongIncarnation
from paramserver.server.build import build_coordinator
from paramserver.server.disk import checkpoint
from paramserver.server.disk.checkpoint_writer import Checkpointer
from tests.conftest import DEADLINE, FakeClock


def _shard(tmp_path, every: str = "2", resume: bool = False, optimizer: str = "sgd"):
    nn.init.zeros_((model := nn.Linear(4, 1, bias=False)).weight)
    config = ServerConfig(
        policy="sync",
        workers=1,
        shard=0,
        shards=2,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=every,
        optimizer=OptimizerConfig(optimizer, lr=1.0),
    )
    coordinator = build_coordinator(config, model, now=FakeClock(), resume=resume)
    return coordinator, Checkpointer(coordinator, tmp_path, every, cuts=True)


def _rounds(c, member, n: int) -> None:
    for _ in range(n):
        clock = c.membership.get(member.worker_id).clock
        c.push(member.worker_id, clock, np.ones(c.manifest.numel, np.float32), 1, 0.0)


def test_cuts_are_taken_at_every_nth_round_and_kept_from_the_one_every_shard_wrote(tmp_path):
    c, saver = _shard(tmp_path)
    saver.start()  # a fresh shard cuts round 0: where a rewind to the start goes
    assert sorted(checkpoint.list_cuts(tmp_path, 0, 2)) == [0]
    a = c.join("a")
    _rounds(c, a, 5)
    saver.write_cuts()
    # no worker said yet which cuts the other shard wrote: every cut is kept
    assert sorted(checkpoint.list_cuts(tmp_path, 0, 2)) == [0, 2, 4]
    c.saving.learn_common_cut(2)  # a pull: every shard has written round 2 (or later)
    c.saving.learn_common_cut(1)  # an older word changes nothing
    c.saving.learn_common_cut(99)  # never past this shard's own disk
    assert c.cuts.common == 4
    c.cuts.common = 2
    _rounds(c, a, 2)
    saver.stop()
    assert sorted(checkpoint.list_cuts(tmp_path, 0, 2)) == [2, 4, 6]
    state = checkpoint.load(tmp_path / checkpoint.cut_file(0, 2, 4))
    assert state["rounds"] == state["version"] == 4
    assert state["members"][0]["clock"] == 4
    np.testing.assert_array_equal(state["model_state_dict"]["flat"].numpy(), np.full(2, -4.0))

    again, saver2 = _shard(tmp_path, resume=True)  # the newest cut, not the later checkpoint file
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
        policy="async",
        workers=2,
        shard=0,
        shards=2,
        checkpoint_dir=str(tmp_path),
        checkpoint_every="2",
        optimizer=OptimizerConfig("sgd", lr=1.0),
    )
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
    assert not c.saving.cuts_pending
    c.push(b.worker_id, 1, ones, 1, 0.0)  # every clock is 2 now: the cut
    assert c.cuts.last == 2 and c.saving.cuts_pending
    c.pull(a.worker_id, 2, 0.0)  # and a goes on
    saver.write_cuts()
    state = checkpoint.load(tmp_path / checkpoint.cut_file(0, 2, 2))
    assert state["version"] == 4 and {m["clock"] for m in state["members"]} == {2}
    saver.stop()


def test_the_cut_schedule_as_pure_decisions():
    from paramserver.server.bookkeeping.cuts import Cuts

    sync = Cuts(every=5, synchronous=True)
    assert [sync.after_round(r) for r in (4, 5, 6, 10)] == [None, 5, None, 10]
    assert sync.next is None and not sync.holds(100, 0)
    free = Cuts(every=5)
    assert free.next == 5 and free.reached(4) is None and free.reached(5) == 5
    assert free.holds(5, 4) and free.holds(7, 4) and not free.holds(4, 0)
    free.take(5, {"cut": 5})
    assert free.next == 10 and not free.holds(7, 5) and free.oldest() == {"cut": 5}
    assert Cuts().next is None and not Cuts().holds(3, 0)  # a server that does not cut
    # the run's end (the last worker left): a cut there unless one is (sync only)
    sync.take(5, {"cut": 5})
    assert sync.at_end(5) is None and sync.at_end(7) == 7
    assert free.at_end(7) is None and Cuts(synchronous=True).at_end(7) is None


def test_cuts_wait_in_memory_until_on_disk_a_bounded_few_and_disk_keeps_the_common_one():
    from paramserver.server.bookkeeping.cuts import MAX_PENDING, Cuts

    cuts = Cuts(every=1, synchronous=True)
    for r in range(1, MAX_PENDING + 1):
        assert not cuts.full
        cuts.take(r, {"cut": r})
    assert cuts.full  # pulls wait now
    assert cuts.oldest() == {"cut": 1}  # a failed write leaves it taken
    cuts.on_disk(1)
    assert not cuts.full and cuts.oldest() == {"cut": 2} and cuts.written == 1
    assert cuts.pending_at(2) == {"cut": 2} and cuts.pending_at(1) is None
    cuts.on_disk(2)
    cuts.learn_common(1)
    assert cuts.deletable([0, 1, 2]) == [0]  # round 1 is on every shard's disk
    cuts.take(3, {"cut": 3})
    cuts.rewound(2, on_disk=[1, 2])  # another shard restarted from round 2
    assert cuts.pending == [] and cuts.written == 2 and cuts.common == 1


def test_a_cut_whose_write_fails_stays_taken_pulls_wait_and_it_lands_once_the_disk_is_back(
    tmp_path,
):
    """A failed checkpoint write loses nothing, in process: a write
    that fails (the folder is gone, a file in its place: as a read-only or unmounted folder,
    which root cannot be kept out of by permissions) leaves the cut taken; pulls wait while
    MAX_PENDING are; the write succeeds once the folder is back, and nothing was dropped."""
    folder = tmp_path / "cuts"
    c, saver = _shard(folder, every="1")
    saver.start()
    a = c.join("a")
    parked = tmp_path / "parked"
    folder.rename(parked)
    folder.write_text("not a folder")
    _rounds(c, a, 2)  # the cuts at rounds 1 and 2 are taken
    assert not saver.write_due()
    assert [s["cut"] for s in c.cuts.pending] == [1, 2]
    assert c.saves.failing and str(folder) in c.saves.error and "free there" in c.saves.error
    with pytest.raises(Timeout, match="2 consistent cuts wait to be written to disk"):
        c.pull(a.worker_id, 2, 0.0)
    assert c.status().checkpoint_failing_seconds >= 0
    with saver._lock:  # no retry of the loop's lands between the two (it would make the folder)
        folder.unlink()
        parked.rename(folder)
    assert saver.write_due()
    assert sorted(checkpoint.list_cuts(folder, 0, 2)) == [0, 1, 2]
    assert not c.saving.cuts_pending and not c.saves.failing and c.saves.failures >= 1
    assert c.pull(a.worker_id, 2, 0.0).version == 2  # and the run goes on
    saver.stop()


def test_a_first_cut_that_cannot_be_written_is_refused_at_start_in_one_line(tmp_path, monkeypatch):
    """Issue 55's review: a fresh shard writes its first cut as it starts; a full disk there
    was a traceback and exit 1."""
    _, saver = _shard(tmp_path)

    def full(_state) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(saver, "_write_cut", full)
    with pytest.raises(ConfigError, match=r"first cut of shard 0/2 .*: No space left on device"):
        saver.start()


def test_a_rewind_to_a_cut_of_another_optimizer_changes_nothing(tmp_path):
    """Issue 55's review: a cut written before --switch-optimizer, rewound to by a shard
    started without it, was refused halfway (later cuts deleted, clocks rewound, weights
    not): it is refused before anything changes."""
    c, saver = _shard(tmp_path)
    saver.start()
    _rounds(c, c.join("a"), 5)
    saver.stop()  # cuts 0, 2, 4 of sgd's state
    d, other = _shard(tmp_path, optimizer="adam")  # not resumed: a run of its own
    b = d.join("b")
    _rounds(d, b, 1)
    was = (d.incarnation, d.rounds, d.store.weights.copy())
    with pytest.raises(ConfigError, match="--optimizer sgd, whose state --optimizer adam"):
        other.rewind(2, d.incarnation)  # cut 4, later, stays too
    assert sorted(checkpoint.list_cuts(tmp_path, 0, 2)) == [0, 2, 4]
    assert (d.incarnation, d.rounds) == was[:2]
    np.testing.assert_array_equal(d.store.weights, was[2])
    assert d.membership.get(b.worker_id).clock == 1
