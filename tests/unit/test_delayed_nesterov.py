"""Delayed Nesterov (``--optimizer delayed-nesterov``, server/optim/outer.py): the
outer optimizer of asynchronous local steps. Its steps against the paper's rule worked by
hand, its period-1 form against torch's Nesterov, and its period resolved from the run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.errors import ConfigError
from paramserver.server.bookkeeping.store import ParameterStore

MANIFEST = Manifest.from_tensors([("w", torch.zeros(3, 4)), ("b", torch.zeros(3))])


def _grads(steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(MANIFEST.numel).astype(np.float32) for _ in range(steps)]


def _start() -> np.ndarray:
    return np.linspace(-1.0, 1.0, MANIFEST.numel, dtype=np.float32)


def test_period_one_is_torchs_nesterov():
    ours = ParameterStore(
        MANIFEST, _start(), OptimizerConfig("delayed-nesterov", 0.7, 0.9, period=1)
    )
    torchs = ParameterStore(MANIFEST, _start(), OptimizerConfig("nesterov", 0.7, 0.9))
    for g in _grads(6):
        ours.apply(g)
        torchs.apply(g)
    np.testing.assert_allclose(ours.weights, torchs.weights, rtol=1e-6, atol=1e-6)


def test_each_push_at_lr_over_n_and_the_momentum_once_every_n():
    lr, beta, n = 0.7, 0.9, 3
    rates = [lr, lr, 0.5, 0.5, 0.25, 0.25, 0.1]  # a schedule: each step its own rate
    store = ParameterStore(
        MANIFEST, _start(), OptimizerConfig("delayed-nesterov", lr, beta, period=n)
    )
    p = _start().astype(np.float64)
    m = np.zeros_like(p)
    pending = np.zeros_like(p)
    for t, (g, rate) in enumerate(zip(_grads(len(rates)), rates, strict=True), start=1):
        store.step(g, rate)
        pending += g
        p -= rate / n * g  # every push, at once
        if t % n == 0:  # every n-th: the momentum moves by the mean of the n pushes
            m = beta * m + pending / n
            pending[:] = 0
            p -= rate * beta * m
        np.testing.assert_allclose(store.weights, p, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
    held = store.optimizer.state[store.param]
    assert float(held["step"]) == len(rates)
    np.testing.assert_allclose(held["momentum_buffer"].numpy(), m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(held["pending"].numpy(), pending, rtol=1e-5, atol=1e-6)


def test_its_state_goes_through_a_state_dict():
    cfg = OptimizerConfig("delayed-nesterov", 0.7, 0.9, period=2)
    a = ParameterStore(MANIFEST, _start(), cfg)
    grads = _grads(5)
    for g in grads[:3]:
        a.apply(g)
    b = ParameterStore(MANIFEST, a.weights.copy(), cfg)
    b.optimizer.load_state_dict(a.optimizer_state())
    for g in grads[3:]:
        a.apply(g)
        b.apply(g)
    np.testing.assert_array_equal(a.weights, b.weights)


def test_the_period_is_the_workers_under_async_and_one_under_sync():
    dn = OptimizerConfig("delayed-nesterov", 0.7)
    assert ServerConfig(policy="async", workers=4, optimizer=dn).outer_optimizer().period == 4
    assert ServerConfig(policy="ssp:2", workers=3, optimizer=dn).outer_optimizer().period == 3
    assert ServerConfig(policy="sync", workers=4, optimizer=dn).outer_optimizer().period == 1
    given = OptimizerConfig("delayed-nesterov", 0.7, period=8)
    assert ServerConfig(policy="async", workers=4, optimizer=given).outer_optimizer().period == 8
    adam = ServerConfig(policy="async", workers=4)
    assert adam.outer_optimizer() is adam.optimizer


def test_a_period_is_refused_for_another_optimizer_and_below_zero():
    with pytest.raises(ConfigError, match="--nesterov-period is for --optimizer delayed-nesterov"):
        OptimizerConfig("nesterov", 0.7, period=2)
    with pytest.raises(ConfigError, match="--nesterov-period must be zero or more"):
        OptimizerConfig("delayed-nesterov", 0.7, period=-1)
