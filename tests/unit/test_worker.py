"""The Worker's state machine over an in-process channel: every step path, lost replies,
retries with backoff on a fake clock, rejoins after a restart (ABORTED) or a dropped lease
(NOT_FOUND), sharded servers, and close. No sockets; the servers are real Coordinators."""

from __future__ import annotations

import copy
import logging

import grpc
import numpy as np
import pytest
import torch
from torch import nn

import paramserver as ps
from paramserver.codec import compression
from paramserver.transport import shm as shmem
from paramserver.worker.pipeline import StepMode
from paramserver.worker.session import SessionState
from paramserver.worker.waits import Backoff
from tests.conftest import FakeClock
from tests.inprocess import FakeServer, shards_with_cuts

LR = 0.5
LEASE = 10.0
needs_shm = pytest.mark.skipif(not shmem.available(), reason="no writable /dev/shm")


def zero_model(n_in: int = 4, n_out: int = 1) -> nn.Module:
    model = nn.Linear(n_in, n_out, bias=False)
    nn.init.zeros_(model.weight)
    return model


def one_step(worker: ps.Worker, model: nn.Module, **kw) -> None:
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    worker.step(samples=1, **kw)


class Sleeps:
    """The worker's wait between retries: records the delay and moves the fake clock."""

    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.delays: list[float] = []

    def __call__(self, delay: float) -> bool:
        self.delays.append(delay)
        self.clock.advance(delay)
        return False


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_worker(server: FakeServer, model: nn.Module, clock: FakeClock, **kw) -> ps.Worker:
    channels = []

    def channel(address: str):
        channels.append(server.channel(address))
        return channels[-1]

    kw.setdefault("shm", False)
    worker = ps.Worker(
        "in-process:1", model, channel=channel, clock=clock, sleep=Sleeps(clock), **kw
    )
    worker.channels = channels  # type: ignore[attr-defined]
    return worker


PATHS = [
    ("sync", False, False, StepMode.BLOCKING),
    ("sync", True, True, StepMode.OVERLAPPED),
    ("delay-1", False, False, StepMode.BLOCKING),
    ("delay-1", False, True, StepMode.BLOCKING),
    ("delay-1", True, False, StepMode.OVERLAPPED),
    ("delay-1", True, True, StepMode.PREFETCHING),
    ("async", True, False, StepMode.OVERLAPPED),
    ("async", True, True, StepMode.PREFETCHING),
    ("ssp:3", False, True, StepMode.BLOCKING),
]


@pytest.mark.parametrize(("policy", "overlap", "shm", "mode"), PATHS)
def test_every_step_path_applies_each_push_exactly_once(clock, policy, overlap, shm, mode):
    if shm and not shmem.available():
        pytest.skip("no writable /dev/shm")
    server = FakeServer(zero_model(), clock, policy=policy, workers=1)
    model = zero_model()
    worker = make_worker(server, model, clock, overlap=overlap, shm=shm)
    assert worker.mode is mode and worker.shm_active is shm
    steps = 9
    for _ in range(steps):
        one_step(worker, model)
    one_step(worker, model, pull=False)
    worker.close()
    status = server.coordinator.status().as_dict()
    assert status["version"] == steps + 1
    assert status["pushes_applied"] == steps + 1 and status["duplicates"] == 0
    # all-ones gradients under SGD from zero: every weight is exactly -LR * pushes
    np.testing.assert_array_equal(server.coordinator.store.weights, np.full(4, -LR * (steps + 1)))
    # the model holds the weights of the last pull, which lack at most what the policy
    # lets it miss: prefetch computes on weights one step behind its own; an overlapped
    # pull may be answered before its own pushes in flight (one a slot) land
    slots = worker.policy.max_inflight_pushes()
    behind = {
        StepMode.BLOCKING: {0},
        StepMode.OVERLAPPED: set(range(slots + 1)),
        StepMode.PREFETCHING: {1},
    }
    if policy == "sync":
        behind[StepMode.OVERLAPPED] = {0}
    assert {int(steps + model.weight.detach()[0, 0].item() / LR)} <= behind[mode]
    bound = worker.policy.bound
    assert bound is None or status["max_staleness"] <= bound


@pytest.mark.parametrize("shm", [False, pytest.param(True, marks=needs_shm)])
def test_a_push_whose_reply_is_lost_is_retried_and_acknowledged_once(clock, shm):
    server = FakeServer(zero_model(), clock, policy="delay-1", workers=1)
    model = zero_model()
    worker = make_worker(server, model, clock, overlap=False, shm=shm)
    channel = worker.channels[0]  # type: ignore[attr-defined]
    channel.lose["PushPull" if shm else "Push"] = 2
    for _ in range(4):
        one_step(worker, model)
    worker.close()
    status = server.coordinator.status().as_dict()
    assert status["duplicates"] == 2
    assert status["version"] == status["pushes_applied"] == 4
    assert worker.clock == 4


def test_an_unreachable_server_is_retried_with_backoff_then_given_up(clock):
    server = FakeServer(zero_model(), clock, policy="async", workers=1)
    model = zero_model()
    worker = make_worker(server, model, clock, overlap=False, server_timeout=30.0)
    sleeps = worker.sessions[0]._sleep
    channel = worker.channels[0]  # type: ignore[attr-defined]
    channel.fail["Pull"].extend([grpc.StatusCode.UNAVAILABLE] * 3)
    worker.pull()
    assert len(sleeps.delays) == 3 and all(0 <= d < 0.1 * 2**i for i, d in enumerate(sleeps.delays))
    sleeps.delays.clear()
    channel.fail["Pull"].extend([grpc.StatusCode.UNAVAILABLE] * 10_000)
    with pytest.raises(ps.ServerUnavailable, match="did not come back within 30s"):
        worker.pull()
    # the second outage alone: the budget, plus at most one capped delay
    assert 30.0 <= sum(sleeps.delays) < 30.0 + 2.0
    channel.fail["Pull"].clear()
    worker.close()


def test_pushes_and_joins_past_their_deadline_are_retried_and_pulls_are_not(clock):
    """A link down for longer than a call's deadline: a push (acknowledged once however
    often it arrives) and a join (one join_id) are tried again; a pull past its barrier
    timeout fails, as --barrier-timeout says (and so does a step's push and pull in one
    call, whose deadline is the pull's)."""
    server = FakeServer(zero_model(), clock, policy="async", workers=1)
    model = zero_model()
    worker = make_worker(server, model, clock, overlap=False, server_timeout=30.0)
    channel = worker.channels[0]  # type: ignore[attr-defined]
    channel.fail["Push"].extend([grpc.StatusCode.DEADLINE_EXCEEDED] * 2)
    one_step(worker, model, pull=False)  # a push alone (a push and pull in one: a pull)
    assert worker.clock == 1 and not channel.fail["Push"]
    worker.pull()
    server.coordinator.leave(worker.worker_id)  # dropped: the next call rejoins
    channel.fail["Join"].extend([grpc.StatusCode.DEADLINE_EXCEEDED] * 2)
    one_step(worker, model)
    assert worker.sessions[0].rejoins == 1 and not channel.fail["Join"]
    channel.fail["Pull"].append(grpc.StatusCode.DEADLINE_EXCEEDED)
    with pytest.raises(ps.Timeout):
        worker.pull()
    worker.close()
    status = server.coordinator.status().as_dict()
    # the first push once; the second met the drop (it rejoined instead), as any dropped step
    assert status["pushes_applied"] == 1 and status["duplicates"] == 0


def test_top_k_residual_outlives_retries_and_is_dropped_on_rejoin_with_a_line(clock, caplog):
    server = FakeServer(zero_model(), clock, policy="async", workers=1)
    model = zero_model()
    worker = make_worker(server, model, clock, overlap=False, compress="topk:0.2")
    channel = worker.channels[0]  # type: ignore[attr-defined]
    codec = worker._attacher.codecs[0]
    one_step(worker, model)
    held = codec.residual.clone()
    assert held.abs().sum() > 0  # 80% of the ones wait for the next push
    # what one selection of the next push's ones leaves: a retry must not select again
    expected = copy.deepcopy(codec)
    expected._select(torch.ones(codec.m + codec.exact))
    channel.lose["Push"] = 1  # the reply is lost, as on a dropped connection: the retry
    one_step(worker, model)  # sends the same pairs
    assert server.coordinator.status().as_dict()["duplicates"] == 1
    assert worker._attacher.codecs[0] is codec  # the residual outlived the lost reply
    assert torch.equal(codec.residual, expected.residual)
    server.coordinator.leave(worker.worker_id)
    with caplog.at_level(logging.INFO, logger="paramserver.worker.attach"):
        one_step(worker, model)
    assert "drops the top-k residual" in caplog.text
    assert worker._attacher.codecs[0] is not codec
    worker.close()


@pytest.mark.parametrize("compress", ["int8", "bf16", "fp16"])
def test_a_rounding_residual_outlives_retries_and_is_dropped_on_rejoin_with_a_line(
    clock, caplog, compress
):
    """int8's, and fp16's and bf16's (error feedback on 16 bits), as top-k's above."""
    server = FakeServer(zero_model(), clock, policy="async", workers=1)
    model = zero_model()
    worker = make_worker(server, model, clock, overlap=False, compress=compress)
    channel = worker.channels[0]  # type: ignore[attr-defined]
    codec = worker._attacher.codecs[0]
    assert isinstance(codec, compression.Feedback) and not codec.residual.any()
    grad = torch.tensor([[1.0, 0.3, 0.001, -0.5]])  # 0.3 * 127 = 38.1; 0.3 in 16 bits: rounded

    def step() -> None:
        model.weight.grad = grad.clone()
        worker.step(samples=1)

    step()
    assert codec.residual.abs().sum() > 0
    expected = copy.deepcopy(codec)  # one more quantisation of the same gradient
    expected.encode(grad.reshape(-1), key="once")
    channel.lose["Push"] = 1  # the reply is lost: the retry sends the same bytes
    step()
    assert server.coordinator.status().as_dict()["duplicates"] == 1
    assert worker._attacher.codecs[0] is codec
    assert torch.equal(codec.residual, expected.residual)  # moved once
    server.coordinator.leave(worker.worker_id)
    with caplog.at_level(logging.INFO, logger="paramserver.worker.attach"):
        step()
    assert f"drops the {compress} residual" in caplog.text
    assert worker._attacher.codecs[0] is not codec
    worker.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_restarted_server_is_joined_again_and_training_goes_on(clock, overlap):
    server = FakeServer(zero_model(), clock, policy="delay-1", workers=1)
    model = zero_model()
    worker = make_worker(server, model, clock, overlap=overlap)
    for _ in range(3):
        one_step(worker, model)
    worker.flush()
    incarnation = worker.incarnation
    server.restart()  # every call of the old incarnation is now ABORTED
    rewound = []
    for _ in range(3):
        try:
            one_step(worker, model)
        except ps.ServerRewound as exc:  # the push that met the restart: the loop is told
            rewound.append((exc.step, exc.lost))
    worker.close()
    assert rewound == [(3, 1)]
    assert worker.rejoins == 1 and worker.incarnation != incarnation
    assert worker.sessions[0].state is SessionState.CLOSED
    status = server.coordinator.status().as_dict()
    # the push that met the restart was dropped; the rest were applied once each
    assert status["version"] == worker.clock
    np.testing.assert_array_equal(server.coordinator.store.weights, np.full(4, -LR * worker.clock))


def test_a_dropped_lease_is_joined_again_under_a_new_id(clock):
    server = FakeServer(zero_model(), clock, policy="async", workers=2, min_workers=1)
    model = zero_model()
    worker = make_worker(server, model, clock, overlap=False)
    one_step(worker, model)
    old_id = worker.worker_id
    clock.advance(3 * LEASE)
    assert [m.worker_id for m in server.coordinator.expire_leases()] == [old_id]
    one_step(worker, model)  # NOT_FOUND: join again, then go on
    one_step(worker, model)
    assert worker.rejoins == 1 and worker.worker_id != old_id
    worker.close()
    assert server.coordinator.status().as_dict()["workers"] == []


def test_a_heartbeat_that_finds_the_lease_gone_marks_the_session_lost(clock):
    server = FakeServer(zero_model(), clock, policy="async", workers=1)
    model = zero_model()
    worker = make_worker(server, model, clock)
    session = worker.sessions[0]
    worker.heartbeat_once()
    assert session.state is SessionState.LIVE
    worker.channels[0].fail["Heartbeat"].append(grpc.StatusCode.NOT_FOUND)  # type: ignore[attr-defined]
    worker.heartbeat_once()
    assert session.state is SessionState.LOST
    worker.pull()  # joins again before pulling
    assert session.state is SessionState.LIVE and worker.rejoins == 1
    worker.close()


def test_close_leaves_every_server_and_closes_the_connections(clock):
    server = FakeServer(zero_model(), clock, policy="delay-1", workers=1)
    model = zero_model()
    worker = make_worker(server, model, clock, overlap=True)
    one_step(worker, model)
    assert len(server.coordinator.status().as_dict()["workers"]) == 1
    worker.close()
    worker.close()  # twice is harmless
    assert server.coordinator.status().as_dict()["workers"] == []
    assert all(c.closed for c in worker.channels)  # type: ignore[attr-defined]
    assert not worker._heartbeats.alive


@pytest.mark.parametrize("shards", [2, 3])
@pytest.mark.parametrize("shm", [False, pytest.param(True, marks=needs_shm)])
def test_one_worker_drives_every_shard_through_one_flat_buffer(clock, shards, shm):
    start = nn.Linear(5, 2)  # 12 parameters: shards of 6, or of 4
    servers = {
        f"s{i}": FakeServer(start, clock, policy="sync", workers=1, shard=i, shards=shards)
        for i in range(shards)
    }
    model = nn.Linear(5, 2)
    worker = ps.Worker(
        list(servers), model, channel=lambda a: servers[a].channel(a), shm=shm, clock=clock
    )
    # joining loaded the servers' weights into the model
    assert torch.equal(model.weight, start.weight) and torch.equal(model.bias, start.bias)
    assert worker.shards == shards and worker.shm_active is shm
    assert [lo for lo, _ in worker.ranges] == [s.coordinator.shard_offset for s in servers.values()]
    for _ in range(5):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        worker.step(samples=1)
    worker.close()
    flat = np.concatenate([s.coordinator.store.weights for s in servers.values()])
    expected = torch.cat([start.weight.reshape(-1), start.bias]).detach().numpy() - LR * 5
    np.testing.assert_allclose(flat, expected, rtol=0, atol=1e-6)
    got = torch.cat([model.weight.reshape(-1), model.bias]).detach().numpy()
    np.testing.assert_array_equal(got, flat)


@pytest.mark.parametrize("policy", ["sync", "delay-1", "async"])
def test_a_restarted_shard_and_the_others_resume_from_one_cut(clock, tmp_path, policy):
    servers = shards_with_cuts(zero_model(6), clock, str(tmp_path), policy=policy, workers=1)
    model = zero_model(6)
    worker = ps.Worker(
        list(servers), model, channel=lambda a: servers[a].channel(a), shm=False, clock=clock
    )
    for _ in range(3):
        one_step(worker, model)
    servers["s1"].restart()  # from its newest cut, at clock 2; s0 is at clock 3
    rewound = []
    for _ in range(3):
        try:
            one_step(worker, model)
        except ps.ServerRewound as exc:
            rewound.append((exc.step, exc.lost))
    worker.close()
    assert rewound == [(2, 2)]  # the cut's clock; the step after it and the one that met it
    assert [s.rejoins for s in worker.sessions] == [1, 1]  # s1 restarted, s0 rewound
    status = [s.coordinator.status() for s in servers.values()]
    # both shards hold the same pushes: the cut's 2, then the 2 after the step whose
    # push met the restart (dropped on s1, undone on s0)
    assert [st.version for st in status] == [4, 4]
    for s in servers.values():
        np.testing.assert_array_equal(s.coordinator.store.weights, np.full(3, -LR * 4))
    # the model the worker holds is one model: both ranges at the same version
    assert torch.equal(model.weight, torch.full((1, 6), model.weight.detach()[0, 0].item()))


def test_shards_out_of_order_or_alone_are_refused_before_training(clock):
    servers = {
        f"s{i}": FakeServer(zero_model(6), clock, policy="sync", workers=1, shard=i, shards=2)
        for i in range(2)
    }

    def channel(a):
        return servers[a].channel(a)

    with pytest.raises(ps.ConfigError, match="given as shard 0 of 2"):
        ps.Worker(["s1", "s0"], zero_model(6), channel=channel)
    with pytest.raises(ps.ConfigError, match="shard 1 of 2.*every shard's address"):
        ps.Worker("s1", zero_model(6), channel=channel)
    with pytest.raises(ps.ConfigError, match="model of 6 parameters; the local model has 4"):
        ps.Worker(["s0", "s1"], zero_model(4), channel=channel)
    for s in servers.values():
        assert s.coordinator.status().as_dict()["workers"] == []


def test_backoff_delays_grow_to_the_cap_with_full_jitter():
    clock = FakeClock(0.0)
    top = Backoff(budget=10, now=clock, rng=lambda: 0.999999)
    assert [round(top.delay(i), 3) for i in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert Backoff(budget=10, rng=lambda: 0.0).delay(5) == 0.0
    assert top.delay(10_000) == pytest.approx(2.0, rel=1e-5)
    assert not top.expired(0.0)
    clock.advance(10)
    assert top.expired(0.0)


def test_frozen_parameters_are_neither_sent_nor_updated(clock):
    def partly_frozen() -> nn.Module:
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1, bias=False))
        m[0].requires_grad_(False)
        return m

    server = FakeServer(partly_frozen(), clock, policy="async", workers=1)
    model = partly_frozen()
    frozen = {k: v.clone() for k, v in model[0].state_dict().items()}
    worker = make_worker(server, model, clock)
    assert [t.name for t in worker.manifest.tensors] == ["1.weight"]
    for _ in range(3):
        torch.nn.functional.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)).backward()
        worker.step()
    worker.close()
    for k, v in model[0].state_dict().items():
        assert torch.equal(v, frozen[k]), k
    status = server.coordinator.status()
    assert status.version == 3 and status.bytes_in == 3 * 3 * 4  # 3 pushes of 3 floats
    assert not torch.equal(model[1].weight, partly_frozen()[1].weight)  # the rest trained


@pytest.mark.parametrize("flat", [False, True], ids=["tensors", "flat"])
def test_a_parameter_frozen_or_unfrozen_after_the_join_is_refused_in_one_line(clock, flat):
    """Issue 56, must 7: a layer unfrozen after the join was silently never trained (the
    servers carry the parameters trainable at the join), and one frozen after it was still
    stepped. Either is refused at the next step, naming it; put back, training goes on."""

    def two_layers() -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 1))
        model[0].requires_grad_(False)
        return model

    server = FakeServer(two_layers(), clock, policy="async", workers=1)
    model = two_layers()
    worker = make_worker(server, model, clock, flat=flat)
    model[0].weight.requires_grad_(True)
    with pytest.raises(ps.ConfigError, match=r"Parameter '0.weight' was unfrozen after the worker"):
        worker.step(samples=1)
    model[0].weight.requires_grad_(False)
    model[1].bias.requires_grad_(False)
    with pytest.raises(ps.ConfigError, match=r"Parameter '1.bias' was frozen after the worker"):
        worker.step(samples=1)
    model[1].bias.requires_grad_(True)
    one_step(worker, model)
    worker.close()
    assert server.coordinator.store.version == 1
