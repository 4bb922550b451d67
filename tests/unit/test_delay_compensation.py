"""--delay-compensation (server/bookkeeping/compensation.py): DC-ASGD's adaptive correction
of a stale gradient, g + C / lr * g * g * (w_now - w_read) / (sqrt(v) + eps), with the
weights each pull answered kept by (worker, iteration) until its push takes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.errors import ConfigError
from paramserver.server.bookkeeping import compensation
from paramserver.server.bookkeeping.compensation import Reads
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.engine.coordinator import Coordinator

N = 6
C = 0.2
LR = 0.1  # C / LR = 2


def test_a_read_is_taken_by_its_own_push_and_earlier_ones_go():
    reads = Reads(C, N)
    w = np.arange(N + 2, dtype=np.float32)  # the buffers after the parameters are not kept
    reads.remember("a", 0, w)
    reads.remember("a", 1, w + 1)  # a prefetch: the next iteration's, before 0 is pushed
    reads.remember("b", 0, w + 2)
    got = reads.take("a", 1)  # 1's push: 0's read goes too (its clock moved past it)
    assert got is not None and np.array_equal(got, (w + 1)[:N])
    assert reads.take("a", 0) is None and reads.held == 1
    assert reads.take("a", 2) is None  # never pulled: applied as it came
    w[:] = -1  # a copy, not a view of the weights that move on
    assert np.array_equal(reads.take("b", 0), np.arange(N, dtype=np.float32) + 2)


def test_reads_are_bounded_recycled_and_forgotten_with_their_worker():
    reads = Reads(C, N)
    w = np.zeros(N, np.float32)
    for it in range(compensation.KEEP_A_WORKER + 3):
        reads.remember("a", it, w + it)
    assert reads.held == compensation.KEEP_A_WORKER  # the oldest went
    assert reads.take("a", 0) is None
    newest = compensation.KEEP_A_WORKER + 2
    buf = reads.take("a", newest)
    assert buf is not None and buf[0] == newest and reads.held == 0
    reads.give_back(buf)
    reads.remember("b", 0, w)
    assert reads._held[("b", 0)] is buf  # no allocation while buffers come back
    reads.remember("c", 0, w)
    reads.forget(["c"])  # b left
    assert reads.held == 1 and reads.take("b", 0) is None


def test_the_correction_is_dc_asgds_adaptive_form():
    rng = np.random.default_rng(0)
    g, now, read = (rng.standard_normal(N).astype(np.float32) for _ in range(3))
    v = rng.random(N).astype(np.float32) + 0.1
    want = g + C / LR * g * g * (now - read) / (np.sqrt(v) + compensation.EPS)
    frozen = g.copy()
    frozen.setflags(write=False)  # a gradient straight off the wire: corrected in a copy
    got = Reads(C, N).correct(frozen, read.copy(), now, v, LR)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.array_equal(frozen, g)
    mine = g.copy()
    assert Reads(C, N).correct(mine, now.copy(), now, v, LR) is mine  # nothing moved
    assert np.array_equal(mine, g)
    assert Reads(C, N).correct(mine, read.copy(), now, v, 0.0) is mine  # a rate of 0
    assert np.array_equal(mine, g)


def _coordinator(strength: float = C) -> Coordinator:
    manifest = Manifest.from_tensors([("w", torch.zeros(N))])
    opt = OptimizerConfig("adam", lr=LR)
    store = ParameterStore(manifest, np.zeros(N, np.float32), opt)
    config = ServerConfig(policy="async", workers=2, optimizer=opt, delay_compensation=strength)
    return Coordinator(config, store)


def test_a_stale_push_is_corrected_for_the_push_applied_since_its_pull():
    """Two async workers pull version 0; a's push moves the weights; b's gradient, computed
    on version 0, is corrected by how far they moved, with Adam's v, then stepped."""
    c = _coordinator()
    a, b = (c.join(f"w{i}").worker_id for i in range(2))
    c.pull(a, 0, 1.0)
    c.pull(b, 0, 1.0)
    read = c.store.weights[:N].copy()
    ga = np.linspace(-1, 1, N, dtype=np.float32)
    gb = np.linspace(2, -2, N, dtype=np.float32)
    c.push(a, 0, ga.copy(), 1, 0.0)  # nothing moved since a's pull: as it came
    # the same Adam by hand: a's step, then b's corrected gradient
    p = torch.nn.Parameter(torch.zeros(N))
    opt = torch.optim.Adam([p], lr=LR)
    p.grad = torch.from_numpy(ga.copy())
    opt.step()
    np.testing.assert_allclose(c.store.weights[:N], p.detach().numpy(), rtol=1e-6)
    state = opt.state[p]  # Adam's v as its step reads it: bias-corrected
    v = state["exp_avg_sq"].numpy() / (1 - 0.999 ** float(state["step"]))
    moved = p.detach().numpy() - read
    assert np.abs(moved).min() > 0
    corrected = gb + C / LR * gb * gb * moved / (np.sqrt(v) + compensation.EPS)
    c.push(b, 0, gb.copy(), 1, 0.0)
    p.grad = torch.from_numpy(corrected.astype(np.float32))
    opt.step()
    np.testing.assert_allclose(c.store.weights[:N], p.detach().numpy(), rtol=1e-5, atol=1e-7)
    status = c.status()
    assert (status.pushes_compensated, status.pushes_uncompensated) == (2, 0)
    assert c.applies.reads is not None and c.applies.reads.held == 0


def test_without_it_the_stale_push_is_applied_as_it_came():
    c = _coordinator(0.0)
    assert c.applies.reads is None
    a, b = (c.join(f"w{i}").worker_id for i in range(2))
    c.pull(a, 0, 1.0)
    c.pull(b, 0, 1.0)
    c.push(a, 0, np.ones(N, np.float32), 1, 0.0)
    c.push(b, 0, np.ones(N, np.float32), 1, 0.0)
    status = c.status()
    assert (status.pushes_compensated, status.pushes_uncompensated) == (0, 0)


def test_a_push_with_no_read_kept_is_counted_and_applied_as_it_came():
    c = _coordinator()
    a = c.join("w0").worker_id
    c.join("w1")
    c.push(a, 0, np.ones(N, np.float32), 1, 0.0)  # never pulled (a restarted server)
    assert c.status().pushes_uncompensated == 1


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"policy": "sync"}, "--policy sync has no stale gradients"),
        ({"optimizer": OptimizerConfig("sgd")}, "--optimizer adam or adamw, not sgd"),
        ({"server_device": "cuda"}, "on a CPU shard, not --server-device cuda"),
        ({"delay_compensation": -1.0}, "--delay-compensation"),
    ],
)
def test_it_is_refused_where_it_cannot_apply(settings, why, monkeypatch):
    from paramserver.config import server

    monkeypatch.setattr(server, "check_server_device", lambda device: None)  # no GPU here
    base = {"policy": "async", "delay_compensation": 1.0, **settings}
    with pytest.raises(ConfigError, match=why):
        ServerConfig(**base)


def test_it_is_on_by_default_for_a_model_with_tables_where_it_applies():
    from paramserver.config.server import DEFAULT_COMPENSATION

    on = ServerConfig(policy="async")
    assert on.compensation(tables=True) == DEFAULT_COMPENSATION
    assert on.compensation(tables=False) == 0.0  # a dense model: off unless asked
    assert ServerConfig(policy="ssp:2").compensation(True) == DEFAULT_COMPENSATION
    for off in (
        ServerConfig(policy="sync"),
        ServerConfig(policy="async", optimizer=OptimizerConfig("sgd")),
        ServerConfig(policy="async", delay_compensation=0.0),
    ):
        assert off.compensation(tables=True) == 0.0
    assert ServerConfig(policy="async", delay_compensation=1.5).compensation(False) == 1.5


def test_a_server_of_a_model_with_sparse_tables_compensates_by_default():
    from paramserver.server.build import build_coordinator

    class Tabled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(100, 4, sparse=True)
            self.head = torch.nn.Linear(4, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.table(ids))

    tabled = build_coordinator(ServerConfig(policy="async"), Tabled())
    assert tabled.tables is not None and tabled.applies.reads is not None
    assert tabled.applies.reads.strength == 3.0 and tabled.applies.reads.n == 4 * 2 + 2
    assert build_coordinator(ServerConfig(policy="sync"), Tabled()).applies.reads is None
    assert build_coordinator(ServerConfig(policy="async")).applies.reads is None  # the MLP
