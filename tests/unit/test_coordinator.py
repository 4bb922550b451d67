"""The server's state machine, driven directly (no gRPC, no threads) with a fake clock."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.errors import InvalidRequest, OutOfOrder, Timeout, UnknownWorker, WrongIncarnation
from paramserver.server.bookkeeping.snapshot import CoordinatorSnapshot
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.doors.servicer import Servicer
from paramserver.server.engine.coordinator import Coordinator
from paramserver.transport.attachments import Attachments
from tests.conftest import FakeClock

LEASE = 10.0
N = 4  # parameters of the tiny model
NBYTES = 4 * N


def make(
    policy: str, workers: int, clock: FakeClock, snapshot: CoordinatorSnapshot | None = None
) -> Coordinator:
    manifest = Manifest.from_tensors([("w", torch.zeros(N))])
    store = ParameterStore(manifest, np.zeros(N, np.float32), OptimizerConfig("sgd", lr=1.0))
    config = ServerConfig(
        policy=policy,
        workers=workers,
        lease_seconds=LEASE,
        optimizer=OptimizerConfig("sgd", lr=1.0),
        dataset="synthetic",
    )
    return Coordinator(config, store, now=clock, snapshot=snapshot)


def full(value: float) -> np.ndarray:
    return np.full(N, value, np.float32)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


# --- (a) sync ------------------------------------------------------------------------


def test_sync_waits_for_everyone_then_averages(clock: FakeClock) -> None:
    c = make("sync", 2, clock)
    a = c.join("a")
    with pytest.raises(Timeout) as info:
        c.pull(a.worker_id, 0, timeout=0.0)
    assert "1 of 2 workers" in str(info.value)
    b = c.join("b")
    assert (a.rank, b.rank) == (0, 1)
    assert (a.clock, b.clock) == (0, 0)

    first = c.pull(a.worker_id, 0, timeout=0.0)
    assert first.version == 0
    assert first.staleness == 0
    assert np.array_equal(first.weights, np.zeros(N, np.float32))
    assert c.pull(b.worker_id, 0, timeout=0.0).version == 0

    ga, gb = full(1.0), full(3.0)
    ra = c.push(a.worker_id, 0, ga, samples=8, loss=1.0)
    assert (ra.version, ra.clock, ra.duplicate) == (0, 1, False)
    assert c.store.version == 0  # accumulated, not applied
    with pytest.raises(Timeout):
        c.pull(a.worker_id, 1, timeout=0.0)  # round 0 is not complete yet

    rb = c.push(b.worker_id, 0, gb, samples=8, loss=1.0)
    assert (rb.version, rb.clock, rb.duplicate) == (1, 1, False)
    assert c.store.version == 1
    assert np.array_equal(c.store.weights, full(-2.0))  # the mean, applied once
    # The callers' gradient arrays are not modified by the accumulation.
    assert np.array_equal(ga, full(1.0)) and np.array_equal(gb, full(3.0))

    nxt = c.pull(a.worker_id, 1, timeout=0.0)
    assert nxt.version == 1
    assert np.array_equal(nxt.weights, full(-2.0))
    # The first pull's snapshot still holds the old weights.
    assert np.array_equal(first.weights, np.zeros(N, np.float32))
    s = c.status().as_dict()
    assert s["pushes_applied"] == 2
    assert s["samples"] == 16
    assert s["max_staleness"] == 0


def test_sync_pull_too_far_ahead_is_out_of_order(clock: FakeClock) -> None:
    c = make("sync", 1, clock)
    a = c.join("a")
    with pytest.raises(OutOfOrder):
        c.pull(a.worker_id, 2, timeout=0.0)


def test_sync_two_rounds(clock: FakeClock) -> None:
    c = make("sync", 2, clock)
    a, b = c.join("a"), c.join("b")
    for it, (x, y) in enumerate([(1.0, 3.0), (2.0, 4.0)]):
        c.push(a.worker_id, it, full(x), 1, math.nan)
        c.push(b.worker_id, it, full(y), 1, math.nan)
    assert c.store.version == 2
    assert np.array_equal(c.store.weights, full(-5.0))  # -(2) - (3)


# --- (b) sync with a dead worker ---------------------------------------------------------


def test_sync_dead_worker_is_expired_and_round_completes(clock: FakeClock) -> None:
    c = make("sync", 3, clock)
    a, b, dead = c.join("a"), c.join("b"), c.join("c")
    c.push(a.worker_id, 0, full(1.0), 4, 0.5)
    c.push(b.worker_id, 0, full(2.0), 4, 0.5)
    assert c.store.version == 0
    with pytest.raises(Timeout):
        c.pull(a.worker_id, 1, timeout=0.0)

    assert c.expire_leases() == []  # nobody's lease has run out yet
    clock.advance(LEASE + 1.0)
    c.heartbeat(a.worker_id)
    c.heartbeat(b.worker_id)
    expired = c.expire_leases()
    assert [m.worker_id for m in expired] == [dead.worker_id]
    assert sorted(c.membership.live_ids()) == sorted([a.worker_id, b.worker_id])
    assert c.store.version == 1
    assert np.array_equal(c.store.weights, full(-1.5))
    assert c.pull(a.worker_id, 1, timeout=0.0).version == 1
    s = c.status().as_dict()
    assert s["workers_expired"] == 1
    assert len(s["workers"]) == 2
    with pytest.raises(UnknownWorker):
        c.pull(dead.worker_id, 0, timeout=0.0)
    with pytest.raises(UnknownWorker):
        c.push(dead.worker_id, 0, full(1.0), 1, 0.0)


def test_a_server_that_did_not_run_expires_no_lease_and_starts_them_again(clock: FakeClock) -> None:
    """A shard paused (SIGSTOP, a swapped host) longer than the lease heard no heartbeat
    meanwhile: on waking it drops nobody (it once dropped every worker, and its sync rounds
    then ran one behind the other shard's); the leases start again from then."""
    c = make("sync", 2, clock)
    a, b = c.join("a"), c.join("b")
    clock.advance(LEASE * 3)  # the server itself was stopped
    assert c.expire_leases(paused=LEASE * 3) == []
    assert sorted(c.membership.live_ids()) == sorted([a.worker_id, b.worker_id])
    clock.advance(LEASE - 0.5)
    c.heartbeat(a.worker_id)
    clock.advance(1.0)  # b silent for a whole lease since the server woke: it goes
    assert [m.worker_id for m in c.expire_leases()] == [b.worker_id]


def test_leases_are_judged_at_the_reapers_look_not_when_it_got_the_lock(
    clock: FakeClock,
) -> None:
    """The reaper looks (and sees no pause), then waits for the lock; a SIGSTOP there, and
    on waking every lease had run out by the clock, with no gap seen to say the server was
    stopped: the chaos soak's stop-shard could drop every worker of a shard."""
    c = make("sync", 2, clock)
    a, b = c.join("a"), c.join("b")
    looked = clock()
    clock.advance(LEASE * 3)  # stopped between the look and the lock
    assert c.expire_leases(paused=0.0, at=looked) == []
    assert sorted(c.membership.live_ids()) == sorted([a.worker_id, b.worker_id])
    assert len(c.expire_leases()) == 2  # without the look's time, both went


def test_a_returning_leave_leaves_only_the_incarnation_it_names(clock: FakeClock) -> None:
    """A worker's norm relay leaves a shard whose round cannot finish, and joins it again;
    its Leave may land after another worker rewound that shard, whose place for it is the
    cut's: ignored then (it evicted the restored member, whose next join came in under a
    new id at another clock). A plain Leave from before a restart still counts."""
    c = make("sync", 2, clock)
    a, b = c.join("a"), c.join("b")
    assert not c.leave(a.worker_id, incarnation="rewound-since", returning=True)
    assert a.worker_id in c.membership.live_ids()
    assert c.leave(a.worker_id, incarnation=c.incarnation, returning=True)
    assert c.leave(b.worker_id, incarnation="rewound-since")  # leaving for good
    assert c.membership.live_ids() == []


def test_sync_leave_completes_round(clock: FakeClock) -> None:
    c = make("sync", 2, clock)
    a, b = c.join("a"), c.join("b")
    c.push(a.worker_id, 0, full(4.0), 1, 0.0)
    c.leave(b.worker_id)
    assert c.store.version == 1
    assert np.array_equal(c.store.weights, full(-4.0))
    c.leave(b.worker_id)  # leaving twice is harmless
    assert c.store.version == 1


def test_sync_replacement_starts_at_current_round(clock: FakeClock) -> None:
    c = make("sync", 2, clock)
    a, b = c.join("a"), c.join("b")
    c.push(a.worker_id, 0, full(1.0), 1, 0.0)
    c.push(b.worker_id, 0, full(1.0), 1, 0.0)
    c.leave(b.worker_id)
    late = c.join("b2")
    assert late.rank == b.rank
    assert late.clock == 1
    c.push(a.worker_id, 1, full(1.0), 1, 0.0)
    assert c.store.version == 1  # waits for the newcomer
    c.push(late.worker_id, 1, full(3.0), 1, 0.0)
    assert c.store.version == 2


# --- (c) exactly-once pushes and validation ------------------------------------------------


@pytest.mark.parametrize("policy", ["sync", "ssp:1", "async"])
def test_duplicate_push_is_acknowledged_not_applied(policy: str, clock: FakeClock) -> None:
    c = make(policy, 1, clock)
    a = c.join("a")
    r1 = c.push(a.worker_id, 0, full(1.0), 2, 0.0)
    assert r1.duplicate is False
    assert c.store.version == 1
    r2 = c.push(a.worker_id, 0, full(1.0), 2, 0.0)
    assert r2.duplicate is True
    assert r2.version == 1
    assert r2.clock == 1
    assert c.store.version == 1
    assert np.array_equal(c.store.weights, full(-1.0))
    assert c.counters.duplicates == 1
    assert c.status().as_dict()["pushes_applied"] == 1
    assert c.status().as_dict()["samples"] == 2


def test_push_ahead_of_clock_is_out_of_order(clock: FakeClock) -> None:
    c = make("async", 1, clock)
    a = c.join("a")
    with pytest.raises(OutOfOrder) as info:
        c.push(a.worker_id, 1, full(1.0), 1, 0.0)
    assert "clock is 0" in str(info.value)
    assert c.store.version == 0
    assert c.membership.get(a.worker_id).clock == 0


@pytest.mark.parametrize("policy", ["sync", "async"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_push_changes_nothing(policy: str, bad: float, clock: FakeClock) -> None:
    c = make(policy, 1, clock)
    a = c.join("a")
    grad = full(1.0)
    grad[2] = bad
    before = c.status().as_dict()
    with pytest.raises(InvalidRequest):
        c.push(a.worker_id, 0, grad, 1, 0.0)
    after = c.status().as_dict()
    assert c.store.version == 0
    assert np.array_equal(c.store.weights, np.zeros(N, np.float32))
    assert c.membership.get(a.worker_id).clock == 0
    for key in ("pushes_applied", "samples", "bytes_in", "version"):
        assert after[key] == before[key]
    # The worker may retry the same iteration with a good gradient.
    assert c.push(a.worker_id, 0, full(1.0), 1, 0.0).duplicate is False
    assert c.store.version == 1


def test_push_from_unknown_worker(clock: FakeClock) -> None:
    c = make("async", 1, clock)
    c.join("a")
    with pytest.raises(UnknownWorker):
        c.push("nobody", 0, full(1.0), 1, 0.0)


# --- (d) ssp ---------------------------------------------------------------------------


def test_ssp1_bounds_the_lead(clock: FakeClock) -> None:
    c = make("ssp:1", 2, clock)
    a, b = c.join("a"), c.join("b")
    assert c.pull(a.worker_id, 0, timeout=0.0).staleness == 0
    r = c.push(a.worker_id, 0, full(1.0), 1, 0.0)
    assert r.version == 1  # applied on arrival
    # A at clock 1, B at clock 0: iteration 1 is within the bound.
    got = c.pull(a.worker_id, 1, timeout=0.0)
    assert got.staleness == 1
    assert got.version == 1
    c.push(a.worker_id, 1, full(1.0), 1, 0.0)
    with pytest.raises(Timeout) as info:
        c.pull(a.worker_id, 2, timeout=0.0)
    assert "ssp:1" in str(info.value)
    c.push(b.worker_id, 0, full(1.0), 1, 0.0)
    got = c.pull(a.worker_id, 2, timeout=0.0)
    assert got.staleness == 1
    assert got.version == 3
    assert np.array_equal(got.weights, full(-3.0))
    s = c.status().as_dict()
    assert s["max_staleness"] == 1
    assert all(k <= 1 for k in s["staleness_histogram"])
    assert s["staleness_histogram"] == {0: 1, 1: 2}


def test_ssp1_pull_beyond_inflight_is_out_of_order(clock: FakeClock) -> None:
    c = make("ssp:1", 2, clock)
    a, _ = c.join("a"), c.join("b")
    with pytest.raises(OutOfOrder):
        c.pull(a.worker_id, 2, timeout=0.0)


def test_pull_before_start_times_out_under_every_policy(clock: FakeClock) -> None:
    for policy in ("sync", "ssp:1", "async"):
        c = make(policy, 2, clock)
        a = c.join("a")
        with pytest.raises(Timeout):
            c.pull(a.worker_id, 0, timeout=0.0)


# --- (e) async ---------------------------------------------------------------------------


def test_async_never_waits_and_records_staleness(clock: FakeClock) -> None:
    c = make("async", 2, clock)
    a, b = c.join("a"), c.join("b")
    for it in range(5):
        got = c.pull(a.worker_id, it, timeout=0.0)
        assert got.staleness == it  # B is still at clock 0
        assert got.version == it
        c.push(a.worker_id, it, full(1.0), 1, 0.0)
    got = c.pull(a.worker_id, 5, timeout=0.0)
    assert got.staleness == 5
    c.push(b.worker_id, 0, full(1.0), 1, 0.0)
    got = c.pull(b.worker_id, 1, timeout=0.0)
    assert got.staleness == 0  # min clock is B's own, 1
    assert got.version == 6
    assert np.array_equal(got.weights, full(-6.0))
    s = c.status().as_dict()
    assert s["max_staleness"] == 5
    assert s["staleness_histogram"] == {0: 2, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1}


def test_observer_pull_never_waits(clock: FakeClock) -> None:
    c = make("sync", 2, clock)
    got = c.pull("", 0, timeout=0.0)  # before anyone joined
    assert got.version == 0
    assert got.staleness == 0
    assert c.status().as_dict()["staleness_histogram"] == {}
    assert c.status().as_dict()["bytes_out"] == NBYTES


# --- (f) check_push --------------------------------------------------------------------------


def test_push_headers_are_checked_by_the_servicer_before_the_payload(clock: FakeClock) -> None:
    c = make("async", 1, clock)
    a = c.join("a")
    check = Servicer(c, Attachments(NBYTES)).steps.check_push_header

    def header(**kw) -> pb.PushHeader:
        return pb.PushHeader(**{"worker_id": a.worker_id, "total_bytes": NBYTES, **kw})

    check(header())  # valid: no exception
    check(header(dtype="float16", total_bytes=NBYTES // 2))
    check(header(empty=True, total_bytes=0))
    for wrong in (0, NBYTES - 4, NBYTES + 4):
        with pytest.raises(InvalidRequest) as info:
            check(header(total_bytes=wrong))
        assert str(NBYTES) in str(info.value)
    with pytest.raises(InvalidRequest, match="negative"):
        check(header(iteration=-1))
    with pytest.raises(InvalidRequest, match="shard 1 reached shard 0"):
        check(header(shard=1))
    with pytest.raises(InvalidRequest, match="Unknown payload dtype"):
        check(header(dtype="int4"))  # int8 is --compress int8 now
    with pytest.raises(UnknownWorker):
        c.accept_header("nobody")


def test_an_accepted_push_header_renews_the_lease(clock: FakeClock) -> None:
    c = make("async", 1, clock)
    a = c.join("a")
    clock.advance(LEASE - 1)
    c.accept_header(a.worker_id)
    clock.advance(LEASE - 1)
    assert c.expire_leases() == []
    clock.advance(2)
    assert [m.worker_id for m in c.expire_leases()] == [a.worker_id]


def test_the_status_goes_on_the_wire_whole(clock: FakeClock) -> None:
    c = make("ssp:1", 2, clock)
    a = c.join("a")
    c.push(a.worker_id, 0, full(1.0), 16, 2.0)
    msg = c.status().to_proto()
    assert msg.version == 1 and msg.samples == 16 and msg.policy == "ssp:1"
    assert [w.worker_id for w in msg.workers] == [a.worker_id]
    back = {f.name for f in pb.StatusResponse.DESCRIPTOR.fields}
    assert back == set(c.status().as_dict())


# --- (g) status ----------------------------------------------------------------------


def test_status_has_every_field_of_the_wire_message(clock: FakeClock) -> None:
    c = make("ssp:1", 2, clock)
    a, b = c.join("a"), c.join("b")
    c.pull(a.worker_id, 0, timeout=0.0)
    clock.advance(2.0)
    c.push(a.worker_id, 0, full(1.0), 16, 2.0)
    clock.advance(3.0)
    c.push(a.worker_id, 1, full(1.0), 16, 4.0)
    clock.advance(1.0)

    s = c.status().as_dict()
    expected = {f.name for f in pb.StatusResponse.DESCRIPTOR.fields}
    assert set(s) == expected
    worker_fields = {f.name for f in pb.WorkerStatus.DESCRIPTOR.fields}
    assert [set(w) for w in s["workers"]] == [worker_fields, worker_fields]
    assert [w["rank"] for w in s["workers"]] == [0, 1]
    assert s["workers"][0]["worker_id"] == a.worker_id
    assert s["workers"][0]["clock"] == 2
    assert s["workers"][0]["samples"] == 32
    assert s["workers"][0]["last_seen_seconds"] == pytest.approx(1.0)
    assert s["workers"][1]["last_seen_seconds"] == pytest.approx(6.0)
    assert s["version"] == 2
    assert s["policy"] == "ssp:1"
    assert s["pushes_applied"] == 2
    assert s["samples"] == 32
    assert s["bytes_in"] == 2 * NBYTES
    assert s["bytes_out"] == NBYTES
    assert s["train_loss"] == pytest.approx(0.98 * 2.0 + 0.02 * 4.0)
    assert s["train_seconds"] == pytest.approx(3.0)
    assert s["uptime_seconds"] == pytest.approx(6.0)
    assert s["world_size"] == 2
    assert s["workers_joined"] == 2
    assert s["workers_expired"] == 0
    assert s["model"] == "mlp"
    assert s["incarnation"] == c.incarnation

    # The servicer turns it into the wire message without a server or a socket.
    msg = Servicer(c, Attachments(c.manifest.total_bytes)).Status(pb.StatusRequest(), None)
    assert isinstance(msg, pb.StatusResponse)
    assert msg.version == 2
    assert [w.worker_id for w in msg.workers] == [a.worker_id, b.worker_id]
    assert dict(msg.staleness_histogram) == {0: 1}


def test_status_before_any_push(clock: FakeClock) -> None:
    c = make("sync", 1, clock)
    s = c.status().as_dict()
    assert s["train_seconds"] == 0.0
    assert math.isnan(s["train_loss"])
    assert s["workers"] == []
    # NaN loss and an empty membership still make a valid wire message.
    msg = Servicer(c, Attachments(c.manifest.total_bytes)).Status(pb.StatusRequest(), None)
    assert math.isnan(msg.train_loss)
    assert msg.world_size == 1


def test_heartbeat_returns_version_and_unknown_raises(clock: FakeClock) -> None:
    c = make("async", 1, clock)
    a = c.join("a")
    c.push(a.worker_id, 0, full(1.0), 1, 0.0)
    assert c.heartbeat(a.worker_id) == 1
    with pytest.raises(UnknownWorker):
        c.heartbeat("nobody")


def test_min_workers_starts_training_before_every_slot_is_taken(clock: FakeClock) -> None:
    manifest = Manifest.from_tensors([("w", torch.zeros(N))])
    store = ParameterStore(manifest, np.zeros(N, np.float32), OptimizerConfig("sgd", lr=1.0))
    config = ServerConfig(policy="sync", workers=3, min_workers=2, lease_seconds=LEASE)
    c = Coordinator(config, store, now=clock)
    a = c.join("a")
    with pytest.raises(Timeout, match="1 of 2 workers are live"):
        c.pull(a.worker_id, 0, timeout=0)
    b = c.join("b")
    assert c.pull(a.worker_id, 0, timeout=0).version == 0
    c.push(a.worker_id, 0, full(1.0), 1, math.nan)
    c.push(b.worker_id, 0, full(3.0), 1, math.nan)
    late = c.join("late")  # joins mid-run, at the current round
    assert late.clock == 1 and late.rank == 2
    np.testing.assert_array_equal(c.store.weights, full(-2.0))


def test_batches_are_handed_out_and_an_empty_sync_push_counts_for_the_round(
    clock: FakeClock,
) -> None:
    c = make("sync", 2, clock)
    a = c.join("a", train_samples=64 * 3)  # 3 batches of 64, 1 epoch
    b = c.join("b", train_samples=64 * 3)
    assert [c.pull(w.worker_id, 0, 0).batch for w in (a, b)] == [0, 1]
    c.push(a.worker_id, 0, full(1.0), 64, math.nan)
    c.push(b.worker_id, 0, full(3.0), 64, math.nan)
    assert c.pull(a.worker_id, 1, 0).batch == 2
    assert c.pull(b.worker_id, 1, 0).batch == -1  # nothing left this round
    c.push(a.worker_id, 1, full(1.0), 64, math.nan)
    c.push(b.worker_id, 1, None, 0, math.nan)  # empty: counts, does not dilute
    np.testing.assert_array_equal(c.store.weights, full(-3.0))
    assert c.status().as_dict()["batches_done"] == 3
    assert c.pull(a.worker_id, 2, 0).finished


def test_a_pull_ahead_names_the_next_batches_which_stay_the_workers(clock: FakeClock) -> None:
    """Issue 44: a pull that asks ahead also takes the batches of the next iteration for its
    worker (it fetches their rows meanwhile); its pull of that iteration gets them, a retry
    the same, and a worker that leaves gives back both: every batch applied once."""
    c = make("async", 2, clock)
    a = c.join("a", train_samples=64 * 5)  # 5 batches
    b = c.join("b", train_samples=64 * 5)
    first = c.pull(a.worker_id, 0, 0, ahead=True)
    assert (first.batches, first.next_batches) == ((0,), (1,))
    assert c.pull(a.worker_id, 0, 0, ahead=True).next_batches == (1,)  # a retried pull
    assert c.pull(b.worker_id, 0, 0).batches == (2,)  # 1 is a's already
    c.push(a.worker_id, 0, full(1.0), 64, math.nan)
    again = c.pull(a.worker_id, 1, 0, ahead=True)
    assert (again.batches, again.next_batches) == ((1,), (3,))
    c.leave(a.worker_id)  # 1 and 3 go back
    c.push(b.worker_id, 0, full(1.0), 64, math.nan)
    done = [0, 2]
    for t in range(1, 4):
        got = c.pull(b.worker_id, t, 0, ahead=True)
        done += got.batches
        c.push(b.worker_id, t, full(1.0), 64, math.nan)
    assert sorted(done) == [0, 1, 2, 3, 4] and c.status().as_dict()["batches_done"] == 5
    assert c.pull(b.worker_id, 4, 0).finished


def test_a_worker_with_other_data_is_refused(clock: FakeClock) -> None:
    c = make("async", 2, clock)
    c.join("a", train_samples=640)
    with pytest.raises(InvalidRequest, match="same data"):
        c.join("b", train_samples=6400)


def test_skip_nonfinite_counts_and_moves_the_clock(clock: FakeClock) -> None:
    manifest = Manifest.from_tensors([("w", torch.zeros(N))])
    store = ParameterStore(manifest, np.zeros(N, np.float32), OptimizerConfig("sgd", lr=1.0))
    config = ServerConfig(policy="async", workers=1, lease_seconds=LEASE, skip_nonfinite=True)
    c = Coordinator(config, store, now=clock)
    a = c.join("a")
    result = c.push(a.worker_id, 0, full(math.nan), 1, math.nan)
    assert (result.clock, result.version, c.status().as_dict()["pushes_skipped"]) == (1, 0, 1)


def test_checkpoint_state_restores_exactly_and_workers_rejoin_at_their_clock(
    clock: FakeClock,
) -> None:
    c = make("sync", 2, clock)
    a = c.join("a", train_samples=640)
    b = c.join("b", train_samples=640)
    for w, g in ((a, 1.0), (b, 3.0)):
        c.pull(w.worker_id, 0, 0)
        c.push(w.worker_id, 0, full(g), 64, math.nan)
    c.pull(a.worker_id, 1, 0)
    c.push(a.worker_id, 1, full(5.0), 64, math.nan)  # a round in progress
    assert c.pull(b.worker_id, 1, 0).batch == 3  # in flight when the checkpoint is taken
    state = c.checkpoint_state()

    back = make("sync", 2, clock, snapshot=state)
    assert back.incarnation != c.incarnation
    assert (back.store.version, back.rounds) == (1, 1)
    np.testing.assert_array_equal(back.store.weights, c.store.weights)
    with pytest.raises(WrongIncarnation):
        back.check_incarnation(c.incarnation)
    assert back.join("a", worker_id=a.worker_id).clock == 2
    assert back.join("b", worker_id=b.worker_id).clock == 1
    # b finishes the round that a's checkpointed gradient started
    assert back.pull(b.worker_id, 1, 0).batch == 3  # its batch in flight came back
    back.push(b.worker_id, 1, full(1.0), 64, math.nan)
    np.testing.assert_array_equal(back.store.weights, full(-2.0 - 3.0))
    assert back.status().as_dict()["pushes_applied"] == 4


@pytest.mark.parametrize("policy", ["async", "delay-1", "sync"])
def test_a_pull_of_an_iteration_already_pushed_is_refused_before_it_takes_a_batch(
    clock: FakeClock, policy: str
) -> None:
    """Issue 55, defect 8: a worker that pulled an iteration it had pushed took batches it
    could never push (its clock was past them), and the run stalled while it lived."""
    c = make(policy, 1, clock)
    a = c.join("a", train_samples=64 * 4)  # 4 batches
    assert c.pull(a.worker_id, 0, 0).batches == (0,)
    c.push(a.worker_id, 0, full(1.0), 64, math.nan)
    for behind in (0, -1):
        with pytest.raises(OutOfOrder, match="which it pushed already: its clock is 1"):
            c.pull(a.worker_id, behind, 0)
    assert c.queue.taken.get(a.worker_id, {}) == {}  # nothing taken by the refused pulls
    for t in range(1, 4):  # the rest of the run, each batch once
        assert c.pull(a.worker_id, t, 0).batches == (t,)
        c.push(a.worker_id, t, full(1.0), 64, math.nan)
    assert c.members.finished
