"""``server/optim/user_optimizer.py`` on its own (WIP for issue 56 must 2): a user's
AdamW with two groups, built over one shard's pieces or two shards', steps as torch's
AdamW over the model; a piece without a gradient is skipped with its own step count; the
flat state goes out and back in."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from paramserver.server.optim.user_optimizer import GroupedOptimizer, groups_of, pieces


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3))


def factory(named):
    named = list(named)
    decay = [p for n, p in named if p.ndim >= 2]
    rest = [p for n, p in named if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}],
        lr=0.01,
        betas=(0.9, 0.95),
    )


def specs(m: nn.Module):
    out, at = [], 0
    for n, p in m.named_parameters():
        out.append((n, at, p.numel(), tuple(p.shape)))
        at += p.numel()
    return out, at


def grads(m: nn.Module, steps: int):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(p.shape, generator=g) for p in m.parameters()] for _ in range(steps)]


@pytest.mark.parametrize("cuts", [[], [13], [7, 30]])
def test_the_users_groups_step_as_torch_over_any_shards(cuts):
    m = model()
    ref = copy.deepcopy(m)
    opt_ref = factory(ref.named_parameters())
    template, group = groups_of(factory, m)
    sp, n = specs(m)
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    bounds = [0, *cuts, n]
    shards = [
        GroupedOptimizer(template, pieces(sp, group, lo, hi), flat[lo:hi])
        for lo, hi in zip(bounds, bounds[1:], strict=False)
    ]
    gs = grads(m, 6)
    for step, gset in enumerate(gs):
        for p, g in zip(ref.parameters(), gset, strict=True):
            p.grad = g.clone()
        if step % 2 == 1:  # the last layer has no gradient every other step
            ref[2].weight.grad = ref[2].bias.grad = None
        opt_ref.step()
    _run(shards, bounds, gs, sp, n, range(6))
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    torch.testing.assert_close(flat, expected, rtol=1e-6, atol=1e-7)


def test_the_flat_state_goes_out_and_back_in():
    m = model()
    template, group = groups_of(factory, m)
    sp, n = specs(m)
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    one = GroupedOptimizer(template, pieces(sp, group, 0, n), flat)
    gs = grads(m, 4)
    for gset in gs[:2]:
        one.step(torch.cat([g.reshape(-1) for g in gset]))
    saved = one.flat_state(n)
    assert saved["state"][0]["exp_avg"].shape == (n,) and float(saved["state"][0]["step"]) == 2
    assert [row[3] for row in saved["pieces"]] == [2.0] * 6
    twin_flat = flat.clone()
    twin = GroupedOptimizer(template, pieces(sp, group, 0, n), twin_flat)
    twin.load_flat(saved)
    for gset in gs[2:]:
        g = torch.cat([x.reshape(-1) for x in gset])
        one.step(g)
        twin.step(g)
    assert torch.equal(flat, twin_flat)


def test_a_factory_that_fails_or_returns_something_else_is_one_line():
    from paramserver.errors import ConfigError

    with pytest.raises(ConfigError, match="failed: ValueError"):
        groups_of(lambda named: (_ for _ in ()).throw(ValueError("no")), model())
    with pytest.raises(ConfigError, match="returned list"):
        groups_of(lambda named: [], model())
    other = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="not a trainable parameter"):
        groups_of(lambda named: torch.optim.SGD(other.parameters(), lr=0.1), model())


def test_sgd_with_momentum_keeps_its_buffers_through_the_flat_state():
    m = model()
    sgd = lambda named: torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9)  # noqa: E731
    template, group = groups_of(sgd, m)
    sp, n = specs(m)
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    one = GroupedOptimizer(template, pieces(sp, group, 0, n), flat)
    g = torch.ones(n)
    one.step(g)
    saved = one.flat_state(n)
    twin_flat = flat.clone()
    twin = GroupedOptimizer(template, pieces(sp, group, 0, n), twin_flat)
    twin.load_flat(saved)
    one.step(g)
    twin.step(g)
    assert torch.equal(flat, twin_flat) and "step" not in saved["state"][0]


def _run(shards, bounds, gs, sp, n, steps):
    """``steps`` of ``gs`` on ``shards`` (cut at ``bounds``), the head idle every other."""
    for step in steps:
        flat_grad = torch.cat([g.reshape(-1) for g in gs[step]])
        idle = ((sp[4][1], n),) if step % 2 == 1 else ()
        for (lo, hi), shard in zip(zip(bounds, bounds[1:], strict=False), shards, strict=True):
            local = tuple(
                (max(a, lo) - lo, min(b, hi) - lo) for a, b in idle if max(a, lo) < min(b, hi)
            )
            shard.step(flat_grad[lo:hi], 1.0, local)


@pytest.mark.parametrize("before, after", [([7, 30], [13]), ([13], []), ([], [7, 30])])
def test_a_reshard_keeps_each_pieces_own_step(before, after):
    """Resumed on another shard count, a parameter that skipped steps goes on from its own
    step count (it took the largest one: the head, idle every other step, was
    bias-corrected as if it had trained every step)."""
    from paramserver.server.disk.reshard_plan import _optimizer

    m = model()
    ref = copy.deepcopy(m)
    opt_ref = factory(ref.named_parameters())
    gs = grads(m, 7)
    for step, gset in enumerate(gs):  # torch's, the head without a gradient every other step
        for p, g in zip(ref.parameters(), gset, strict=True):
            p.grad = g.clone()
        if step % 2 == 1:
            ref[2].weight.grad = ref[2].bias.grad = None
        opt_ref.step()
    template, group = groups_of(factory, m)
    sp, n = specs(m)
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    old = [0, *before, n]
    shards = [
        GroupedOptimizer(template, pieces(sp, group, lo, hi), flat[lo:hi])
        for lo, hi in zip(old, old[1:], strict=False)
    ]
    _run(shards, old, gs, sp, n, range(4))
    states = [
        {"optimizer_state": s.flat_state(hi - lo)}
        for s, (lo, hi) in zip(shards, zip(old, old[1:], strict=False), strict=True)
    ]
    sizes = [hi - lo for lo, hi in zip(old, old[1:], strict=False)]
    new = [0, *after, n]
    moved = []
    for lo, hi in zip(new, new[1:], strict=False):
        shard = GroupedOptimizer(template, pieces(sp, group, lo, hi), flat[lo:hi])
        shard.load_flat(_optimizer(states, sizes, lo, hi))
        moved.append(shard)
    _run(moved, new, gs, sp, n, range(4, 7))
    expected = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    torch.testing.assert_close(flat, expected, rtol=1e-6, atol=1e-7)
