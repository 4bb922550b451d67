"""A sync round clipped over shards (issue 56 must 4), its parts alone: a shard's round
closes with its part of the squared norm and waits for a total that cannot be smaller than
its part (a worker that lies is refused); meanwhile it counts as ended for lateness and
newcomers. A worker's relay gives the parts' sum to every shard closed at one round, and a
total one shard applied already to the shards it did not reach (a worker that died
between them); it gives nothing while a shard's round is still open."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.errors import InvalidRequest, RejoinRequired, UnknownWorker, WrongIncarnation
from paramserver.server.bookkeeping import norm_round
from paramserver.worker.norm_relay import NormRelay


class FakeStore:
    lr = 0.1
    version = 0

    def __init__(self) -> None:
        self.applied: list[tuple[np.ndarray, float | None]] = []

    def apply(self, grad, idle=(), clip=None) -> None:
        self.applied.append((grad.copy(), clip))
        self.version += 1


def _rounds(clip: float, relay: bool):
    from paramserver.server.bookkeeping.buffers import SharedBuffers
    from paramserver.server.bookkeeping.status import Counters
    from paramserver.server.engine.arrival import Rounds

    store = FakeStore()
    buffers = SharedBuffers.__new__(SharedBuffers)
    buffers.size = 0  # a model without buffers
    r = Rounds(store, None, buffers, Counters())  # type: ignore[arg-type]
    r.clip, r.relay = clip, relay
    return r, store


def test_a_round_closes_with_its_part_and_applies_with_the_total_clipped():
    r, store = _rounds(1.0, relay=True)
    for w, g in (("a", [3.0, 0.0]), ("b", [1.0, 0.0])):
        r.arrive(w, 0, np.array(g, np.float32), [], ["a", "b"])
    assert not r.settle(["a", "b"])  # closed, not applied: it waits for the total
    closing = r.waiting(0)
    assert closing is not None and closing.part == pytest.approx(4.0)  # mean (2, 0)
    assert r.ended == 1 and r.rounds == 0 and r.late("c", 0) and r.start_clock() == 1
    with pytest.raises(InvalidRequest, match="cannot hold this shard's own part"):
        r.finish(0, 3.9)  # smaller than this shard's own part: a lie
    with pytest.raises(InvalidRequest):
        r.finish(0, math.nan)
    assert not r.finish(1, 16.0)  # not the round closing
    assert r.finish(0, 16.0)  # the other shard's part was 12: norm 4, clipped to 1
    ((grad, factor),) = store.applied
    assert factor == pytest.approx(1.0 / (4.0 + norm_round.EPS))
    assert r.rounds == 1 and r.closing is None and r.last == (0, 16.0)


def test_the_next_round_cannot_close_while_one_waits():
    r, store = _rounds(1.0, relay=True)
    r.arrive("a", 0, np.ones(2, np.float32), [], ["a"])
    assert not r.settle(["a"])
    r.arrive("a", 1, np.ones(2, np.float32), [], ["a"])  # a push of the next round
    assert not r.settle(["a"]) and r.waiting(5).round == 0
    assert r.finish(0, 2.0) and r.settle(["a"]) is False and r.waiting(1).round == 1


def test_on_one_server_the_total_is_its_own_part_at_once():
    r, store = _rounds(0.5, relay=False)
    r.arrive("a", 0, np.array([3.0, 4.0], np.float32), [], ["a"])
    assert r.settle(["a"]) and r.rounds == 1  # norm 5 -> clipped to 0.5
    assert store.applied[0][1] == pytest.approx(0.5 / (5.0 + norm_round.EPS))


def test_the_part_counts_the_rows_in_float64():
    from paramserver.codec.rows import RowGradients

    rows = [RowGradients("t", np.array([1, 2]), torch.tensor([[1.0, 2.0], [2.0, 0.0]]))]
    assert norm_round.part_of(np.array([2.0], np.float32), rows) == pytest.approx(13.0)


class FakeSession:
    """A shard's session whose StepNorm answers are scripted: ``state`` is the round
    closing (with its part), or "applied" with the last total."""

    def __init__(self, closing: int, part: float, last: tuple[int, float] = (-1, 0.0)):
        self.worker_id, self.incarnation, self.address = "w", "i", "fake"
        self.closing, self.part, self.last = closing, part, last
        self.given: list[tuple[int, float]] = []
        self.channel = self

    def step_norm(self, request: pb.StepNormRequest, timeout: float | None = None):
        if request.has_total:
            self.given.append((request.round, request.total))
            if request.round == self.closing:
                self.last, self.closing = (request.round, request.total), -1
            return pb.StepNormResponse(round=-1)
        applied = self.last[0] >= request.round
        return pb.StepNormResponse(
            part=self.part if self.closing >= 0 else 0.0,
            closed=self.closing >= 0,
            round=self.closing,
            applied=applied,
            last_round=self.last[0],
            last_total=self.last[1],
        )

    def call(self, what, method, request, timeout=None):
        return method(request, timeout=timeout)

    def leave(self, request: pb.LeaveRequest, timeout: float | None = None):
        self.left = request.returning  # a Leave that stays in the incarnation it names
        return pb.LeaveResponse()


class Restarted(FakeSession):
    """A shard that restarted since the worker joined it: every call is ABORTED."""

    def step_norm(self, request, timeout=None):
        raise WrongIncarnation("restarted")


def _relay(sessions) -> NormRelay:
    closed = threading.Event()
    closed.set()  # its thread ends at once: the test drives ``relay``
    relay = NormRelay(sessions, closed)
    relay._thread.join(5)
    return relay


def test_the_relay_gives_the_sum_to_every_shard_closed_at_the_round():
    shards = [FakeSession(3, 1.5), FakeSession(3, 2.25)]
    relay = _relay(shards)
    assert not relay.relay(3)  # gave the totals; asked again, it is applied
    assert [s.given for s in shards] == [[(3, 3.75)], [(3, 3.75)]]
    assert relay.relay(3)


def test_a_total_one_shard_applied_goes_to_the_shards_a_dead_worker_did_not_reach():
    shards = [FakeSession(-1, 0.0, last=(3, 9.0)), FakeSession(3, 2.0)]
    relay = _relay(shards)
    relay.relay(3)
    assert shards[0].given == [] and shards[1].given == [(3, 9.0)]
    assert relay.relay(3)


def test_nothing_is_given_while_a_shards_round_is_still_open():
    shards = [FakeSession(3, 1.0), FakeSession(-1, 0.0, last=(2, 5.0))]
    relay = _relay(shards)
    assert not relay.relay(3)
    assert shards[0].given == [] and shards[1].given == []


def test_a_restarted_shard_makes_the_worker_leave_the_shards_whose_round_waits():
    """Their round will never have its total (the restarted shard lost its part), and the
    worker's pull there waits on it: leaving ends that pull, and the worker joins again
    and rewinds every shard to the restarted one's cut. Without it a chaos run with the
    clip hung at the first shard kill."""
    shards = [Restarted(-1, 0.0), FakeSession(3, 1.0), FakeSession(-1, 0.0)]
    relay = _relay(shards)
    with pytest.raises(WrongIncarnation):
        relay.relay(3)
    assert getattr(shards[1], "left", False) and not getattr(shards[2], "left", False)
    assert relay.freed == 1 and shards[1].given == []


class RejoinedMeanwhile(FakeSession):
    """A shard that refused the worker (``refusal``), which its main path joined again
    while this StepNorm waited: the answer is of the session the relay asked with."""

    refusal: type[RejoinRequired] = WrongIncarnation

    def step_norm(self, request, timeout=None):
        self.incarnation = "rejoined"
        raise self.refusal("restarted, or the lease ran out")


class LeaseLostRejoined(FakeSession):
    """A shard that dropped the worker (its lease ran out), which the main path joined
    again meanwhile: under a new id, in the same incarnation."""

    def step_norm(self, request, timeout=None):
        self.worker_id = "w-again"
        raise UnknownWorker("its lease ran out")


@pytest.mark.parametrize("stale", [RejoinedMeanwhile, LeaseLostRejoined])
def test_no_shard_is_left_for_a_refusal_the_worker_has_joined_again_since(stale):
    """The relay asked the restarted shard 0 with the old session; by its answer the main
    path had joined it again, pushed there, and rewinds the others itself. Leaving shard 1
    then took a healthy lease from under a push it held (a batch no worker logged)."""
    shards = [stale(-1, 0.0), FakeSession(3, 1.0)]
    relay = _relay(shards)
    with pytest.raises(RejoinRequired):
        relay.relay(3)
    assert not getattr(shards[1], "left", False) and relay.freed == 0


def test_a_round_that_waits_is_held_by_a_checkpoint_as_a_complete_round():
    """A shard stopped while its round waits writes it as a round complete and not applied
    (its batches are in the ledger already): resumed, the round closes again with the same
    mean. Before, the state left it out."""
    from paramserver.server.bookkeeping.sync_round import SyncRound

    r, _ = _rounds(1.0, relay=True)
    for w, g in (("a", [3.0, 1.0]), ("b", [1.0, 0.0])):
        r.arrive(w, 0, np.array(g, np.float32), [], ["a", "b"])
    r.settle(["a", "b"])
    saved = r.closing.round_state()["sync_round"]
    again = SyncRound.from_state(saved, ["a", "b"])
    assert again.complete(["a", "b"])
    np.testing.assert_array_equal(again.take_mean(), np.array([2.0, 0.5], np.float32))


def test_the_relay_relays_rounds_done_again_after_the_worker_joined_again():
    """A rewind makes rounds the relay had seen applied close again; its pushes of them may
    be skipped (every session lost). It relays them once the sessions' incarnations change."""
    shards = [FakeSession(3, 1.0), FakeSession(3, 3.0)]
    closed = threading.Event()
    relay = NormRelay(shards, closed)
    try:
        relay.pushed(3)
        assert relay.settle(5.0) and relay.done == 3
        for s in shards:  # joined again after a rewind to round 2: it closes again
            s.incarnation, s.closing, s.last = "j", 2, (1, 0.5)
        deadline = threading.Event()
        for _ in range(50):
            if all(s.given[-1:] == [(2, 4.0)] for s in shards):
                break
            deadline.wait(0.1)
        assert [s.given[-1] for s in shards] == [(2, 4.0), (2, 4.0)]
    finally:
        closed.set()


@pytest.mark.parametrize(
    ("clip", "shards", "policy", "tables", "want"),
    [
        (0.0, 2, "sync", False, (0.0, False)),  # no clip: no relay (a relay thread, and a
        (0.0, 2, "sync", True, (0.0, False)),  # leave waiting on it, were paid for nothing)
        (1.0, 2, "sync", False, (1.0, True)),
        (1.0, 2, "async", False, (1.0, False)),  # each push says its norm instead
        (1.0, 1, "sync", True, (1.0, False)),  # one shard: the rows' part is its own
        (1.0, 1, "sync", False, (0.0, False)),  # the store clips its own dense part
    ],
)
def test_a_round_waits_for_a_relayed_norm_only_under_a_clip_over_shards(
    clip, shards, policy, tables, want
) -> None:
    from paramserver.config import ServerConfig
    from paramserver.config.optimizer import OptimizerConfig

    config = ServerConfig(
        policy=policy, shards=shards, optimizer=OptimizerConfig(clip=clip, name="sgd")
    )
    assert config.round_clip(tables) == want
