"""The model's buffers on the server (``server/bookkeeping/buffers.py``): float buffers hold the mean of
the latest values of the live workers (under sync, of the round's contributors), integer
buffers the largest; checkpoints keep them. Driven directly, with a fake clock."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from paramserver import models
from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.server.bookkeeping.snapshot import CoordinatorSnapshot
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.engine.coordinator import Coordinator
from tests.conftest import FakeClock

P, B = 2, 2  # parameters, float buffer elements; then one count


def manifest() -> Manifest:
    named = [
        ("w", torch.zeros(P)),
        ("mean", torch.zeros(B)),
        ("n", torch.zeros(1, dtype=torch.int64)),
    ]
    return Manifest.from_tensors(named, ["param", "buffer", "count"])


def make(
    policy: str, workers: int, clock: FakeClock, snapshot: CoordinatorSnapshot | None = None
) -> Coordinator:
    m = manifest()
    store = ParameterStore(m, np.zeros(m.numel, np.float32), OptimizerConfig("sgd", lr=1.0))
    config = ServerConfig(
        policy=policy,
        workers=workers,
        lease_seconds=10.0,
        optimizer=OptimizerConfig("sgd", lr=1.0),
        dataset="synthetic",
    )
    return Coordinator(config, store, now=clock, snapshot=snapshot)


def push(grad: float, mean: tuple[float, float], count: int) -> np.ndarray:
    return np.array([grad, grad, *mean, count], np.float32)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


def test_async_keeps_the_mean_of_the_live_workers_latest_values(clock: FakeClock) -> None:
    c = make("async", 3, clock)
    a, b, d = (c.join(n).worker_id for n in "abd")
    c.push(a, 0, push(1.0, (2.0, 4.0), 5), samples=1, loss=0.0)
    # Only a has pushed values: they are the model's buffers; the gradient went to the params.
    assert c.pull(a, 1, timeout=0).weights.tolist() == [-1.0, -1.0, 2.0, 4.0, 5.0]
    c.push(b, 0, push(0.0, (4.0, 8.0), 3), samples=1, loss=0.0)
    assert c.store.weights[P:].tolist() == [3.0, 6.0, 5.0]  # mean; largest count
    c.push(a, 1, push(0.0, (8.0, 0.0), 6), samples=1, loss=0.0)  # a's latest replaces its first
    assert c.store.weights[P:].tolist() == [6.0, 4.0, 6.0]
    c.push(d, 0, None, samples=0, loss=0.0)  # an empty push carries no values
    assert c.store.weights[P:].tolist() == [6.0, 4.0, 6.0]
    c.leave(a)  # a is gone: only b's values count
    assert c.store.weights[P:].tolist() == [4.0, 8.0, 3.0]
    assert c.store.weights[:P].tolist() == [-1.0, -1.0]  # buffers never reach the optimizer


def test_sync_keeps_the_mean_of_the_rounds_contributors(clock: FakeClock) -> None:
    c = make("sync", 2, clock)
    a, b = (c.join(n).worker_id for n in "ab")
    c.push(a, 0, push(2.0, (1.0, 1.0), 1), samples=1, loss=0.0)
    assert c.store.weights.tolist() == [0.0] * 5  # nothing until the round ends
    c.push(b, 0, push(4.0, (3.0, 5.0), 2), samples=1, loss=0.0)
    assert c.store.weights.tolist() == [-3.0, -3.0, 2.0, 3.0, 2.0]
    # Round 1: b has no batch (an empty push): the round's only contributor is a.
    c.push(a, 1, push(0.0, (7.0, 9.0), 2), samples=1, loss=0.0)
    c.push(b, 1, None, samples=0, loss=0.0)
    assert c.store.weights.tolist() == [-3.0, -3.0, 7.0, 9.0, 2.0]


def test_checkpoint_keeps_the_workers_values(clock: FakeClock) -> None:
    c = make("async", 2, clock)
    a, b = (c.join(n).worker_id for n in "ab")
    c.push(a, 0, push(0.0, (2.0, 2.0), 1), samples=1, loss=0.0)
    c.push(b, 0, push(0.0, (4.0, 4.0), 1), samples=1, loss=0.0)
    fresh = make("async", 2, clock, snapshot=c.checkpoint_state())
    assert fresh.store.weights.tolist() == c.store.weights.tolist()
    # a's value survived the restart: b's next push averages with it.
    fresh.push(b, 1, push(0.0, (6.0, 6.0), 2), samples=1, loss=0.0)
    assert fresh.store.weights[P:].tolist() == [4.0, 4.0, 2.0]


def test_a_batchnorm_model_lays_out_parameters_then_buffers() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model.register_buffer("scratch", torch.zeros(9), persistent=False)  # not in the state
    m, tensors = models.state(model)
    assert [(s.name, s.role) for s in m.tensors] == [
        ("0.weight", "param"),
        ("0.bias", "param"),
        ("1.weight", "param"),
        ("1.bias", "param"),
        ("1.running_mean", "buffer"),
        ("1.running_var", "buffer"),
        ("1.num_batches_tracked", "count"),
    ]
    assert tensors[-1] is model[1].num_batches_tracked
