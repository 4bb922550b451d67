"""The flat parameter store and its server-side optimizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig
from paramserver.server.bookkeeping.store import ParameterStore, build_optimizer

OPTIMIZERS = ["sgd", "momentum", "nesterov", "delayed-nesterov", "adam", "adamw"]  # all of them
MANIFEST = Manifest.from_tensors([("w", torch.zeros(2, 3)), ("b", torch.zeros(2))])


def initial() -> np.ndarray:
    return np.linspace(-1.0, 1.0, MANIFEST.numel, dtype=np.float32)


def grads(seed: int, steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(MANIFEST.numel).astype(np.float32) for _ in range(steps)]


def test_sgd_lr1_subtracts_gradient_exactly() -> None:
    w0 = initial()
    store = ParameterStore(MANIFEST, w0, OptimizerConfig("sgd", lr=1.0))
    assert store.version == 0
    assert np.array_equal(store.weights, w0)
    (g,) = grads(0, 1)
    store.apply(g)
    assert store.version == 1
    assert np.array_equal(store.weights, w0 - g)
    store.apply(g)
    assert store.version == 2
    assert np.array_equal(store.weights, (w0 - g) - g)


def test_initial_array_is_copied() -> None:
    w0 = initial()
    store = ParameterStore(MANIFEST, w0, OptimizerConfig("sgd", lr=1.0))
    w0[:] = 99.0
    assert not np.array_equal(store.weights, w0)
    store.apply(np.ones(MANIFEST.numel, np.float32))
    assert np.all(w0 == 99.0)


def test_gradient_is_not_kept() -> None:
    store = ParameterStore(MANIFEST, initial(), OptimizerConfig("sgd", lr=1.0))
    store.apply(np.ones(MANIFEST.numel, np.float32))
    assert store.param.grad is None


def test_snapshot_read_only_cached_and_refreshed() -> None:
    store = ParameterStore(MANIFEST, initial(), OptimizerConfig("sgd", lr=1.0))
    snap = store.snapshot()
    assert not snap.flags.writeable
    with pytest.raises(ValueError):
        snap[0] = 1.0
    assert store.snapshot() is snap  # cached for this version
    before = snap.copy()
    store.apply(np.full(MANIFEST.numel, 0.5, np.float32))
    # The old snapshot is not changed by the step...
    assert np.array_equal(snap, before)
    new = store.snapshot()
    # ...and the new version gets a new one.
    assert new is not snap
    assert np.array_equal(new, before - 0.5)
    assert store.snapshot() is new


def test_snapshot_is_not_a_view_of_live_weights() -> None:
    store = ParameterStore(MANIFEST, initial(), OptimizerConfig("sgd", lr=1.0))
    snap = store.snapshot()
    assert not np.shares_memory(snap, store.weights)


def _reference(
    cls: type[torch.optim.Optimizer], steps: list[np.ndarray], **kw: float
) -> np.ndarray:
    p = torch.nn.Parameter(torch.from_numpy(initial()))
    opt = cls([p], **kw)
    for g in steps:
        p.grad = torch.from_numpy(g.copy())
        opt.step()
    return p.detach().numpy()


def test_adam_matches_torch() -> None:
    steps = grads(1, 3)
    store = ParameterStore(MANIFEST, initial(), OptimizerConfig("adam", lr=0.01))
    for g in steps:
        store.apply(g)
    expected = _reference(torch.optim.Adam, steps, lr=0.01)
    assert store.version == 3
    assert np.allclose(store.weights, expected, rtol=0, atol=1e-6)
    assert not np.allclose(store.weights, initial(), atol=1e-3)  # it did move


@pytest.mark.parametrize(
    ("cfg", "cls", "kw"),
    [
        (OptimizerConfig("momentum", lr=0.1, momentum=0.9), torch.optim.SGD, {"momentum": 0.9}),
        (OptimizerConfig("adamw", lr=0.01, weight_decay=0.1), torch.optim.AdamW, {}),
        (OptimizerConfig("sgd", lr=0.1, weight_decay=0.5), torch.optim.SGD, {}),
    ],
)
def test_other_optimizers_match_torch(
    cfg: OptimizerConfig, cls: type[torch.optim.Optimizer], kw: dict[str, float]
) -> None:
    steps = grads(2, 3)
    store = ParameterStore(MANIFEST, initial(), cfg)
    for g in steps:
        store.apply(g)
    expected = _reference(cls, steps, lr=cfg.lr, weight_decay=cfg.weight_decay, **kw)
    assert np.allclose(store.weights, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros(MANIFEST.numel - 1, np.float32),
        np.zeros(MANIFEST.numel + 1, np.float32),
        np.zeros(MANIFEST.numel, np.float64),
    ],
)
def test_wrong_initial_raises(bad: np.ndarray) -> None:
    with pytest.raises(ValueError) as info:
        ParameterStore(MANIFEST, bad, OptimizerConfig("sgd", lr=1.0))
    assert str(MANIFEST.numel) in str(info.value)


def test_cosine_schedule_decays_to_zero_over_total_steps() -> None:
    from paramserver.config import OptimizerConfig

    cfg = OptimizerConfig("sgd", lr=1.0, schedule="cosine", total_steps=4)
    assert [round(cfg.lr_at(s), 6) for s in range(6)] == [1.0, 0.853553, 0.5, 0.146447, 0.0, 0.0]
    store = ParameterStore(
        Manifest.from_tensors([("w", torch.zeros(2))]), np.zeros(2, np.float32), cfg
    )
    for _ in range(3):
        store.apply(np.ones(2, np.float32))
    # sgd with lr 1, then 0.853553, then 0.5: the schedule is applied step by step
    np.testing.assert_allclose(store.weights, -(1.0 + 0.85355339 + 0.5), rtol=1e-6)
    assert store.lr == pytest.approx(0.14644661)


def test_cosine_needs_total_steps() -> None:
    from paramserver.config import OptimizerConfig
    from paramserver.errors import ConfigError

    with pytest.raises(ConfigError, match="--lr-schedule cosine needs --lr-total-steps"):
        OptimizerConfig(schedule="cosine")
    with pytest.raises(ConfigError, match="Unknown learning-rate schedule"):
        OptimizerConfig(schedule="step")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_bare_step_is_the_optimizer_s_step_and_hooks_still_run(name: str) -> None:
    """The store steps its optimizer without torch's profiling wrapper: bit for bit the
    same weights and state as ``optimizer.step()``; with a step hook registered (for every
    optimizer, or for this one) it goes through the wrapper, so the hook runs."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    cfg = OptimizerConfig(name, lr=0.05, momentum=0.9, weight_decay=0.01)
    bare, wrapped = (ParameterStore(MANIFEST, initial(), cfg) for _ in range(2))
    assert bare._bare_step is not None
    wrapped._bare_step = None
    for g in grads(3, 4):
        bare.apply(g)
        wrapped.apply(g)
    np.testing.assert_array_equal(bare.weights, wrapped.weights)
    mine, theirs = (list(s.optimizer.state.values()) for s in (bare, wrapped))
    assert len(mine) == len(theirs) == (0 if name == "sgd" else 1)  # plain SGD keeps none
    for a, b in zip(mine, theirs, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    seen: list[str] = []
    handle = register_optimizer_step_post_hook(lambda opt, *_: seen.append("global"))
    try:
        bare.apply(grads(4, 1)[0])
    finally:
        handle.remove()
    own = bare.optimizer.register_step_post_hook(lambda opt, *_: seen.append("own"))
    bare.apply(grads(5, 1)[0])
    own.remove()
    bare.apply(grads(6, 1)[0])
    assert seen == ["global", "own"]


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n != "delayed-nesterov"])
def test_the_server_steps_with_torchs_fused_kernel(name):
    """One fused pass over the flat buffer (must 2 of the aggregator issue): torch 2.13, the
    pinned one, has it on CPU for every optimizer of torch's that the server offers
    (delayed-nesterov is the server's own: a few in-place passes, outer steps being rare)."""
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(4))], OptimizerConfig(name))
    assert opt.defaults.get("fused") is True


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_idle_range_keeps_its_weights_and_state_through_steps(name: str) -> None:
    """Elements [2, 5) had no gradient at the second and third steps (issue 56, must 7):
    weights and every per-element state stay as the first step left them, decay and
    momentum included; the rest moves as without the range."""
    cfg = OptimizerConfig(
        name, lr=0.1, momentum=0.9, weight_decay=0.1, period=2 if name == "delayed-nesterov" else 0
    )
    plain, skipping = (ParameterStore(MANIFEST, initial(), cfg) for _ in range(2))
    g = grads(3, 3)
    for store in (plain, skipping):
        store.apply(g[0])
    after_first = skipping.weights.copy()
    state = skipping.optimizer.state[skipping.param]
    kept = {k: v[2:5].clone() for k, v in state.items() if v.shape == skipping.param.shape}
    for step in g[1:]:
        plain.apply(step)
        masked = step.copy()
        masked[2:5] = 0  # as a worker pushes a parameter without a gradient
        skipping.apply(masked, ((2, 5),))
    assert np.array_equal(skipping.weights[2:5], after_first[2:5])
    for k, v in kept.items():
        assert torch.equal(state[k][2:5], v), k
    outside = np.r_[0:2, 5 : MANIFEST.numel]
    assert not np.array_equal(skipping.weights[outside], after_first[outside])
    assert np.array_equal(skipping.weights[outside], plain.weights[outside])


def test_state_an_idle_range_never_had_starts_at_zero() -> None:
    store = ParameterStore(MANIFEST, initial(), OptimizerConfig("adam", lr=0.1))
    w0 = store.weights.copy()
    store.apply(np.ones(MANIFEST.numel, np.float32), ((0, 3),))
    state = store.optimizer.state[store.param]
    assert np.array_equal(store.weights[:3], w0[:3])
    assert not state["exp_avg"][:3].any() and not state["exp_avg_sq"][:3].any()
    assert state["exp_avg"][3:].all()
