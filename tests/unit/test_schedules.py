"""The learning-rate schedules a user's recipe asks for (issue 56, must 3): linear warmup,
then constant, or cosine or linear decay to a floor, as a function of the server's step
count, so every shard (and the tables) takes the same rate at the same step. Compared with
torch's own schedulers for the same recipe, step by step."""

from __future__ import annotations

import math

import pytest
import torch

from paramserver.config import OptimizerConfig
from paramserver.errors import ConfigError


def _torch_rates(warmup: int, total: int, floor: float, shape: str) -> list[float]:
    """The rates torch's LambdaLR gives the recipe as users write it (nanoGPT's get_lr)."""

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        p = min(i - warmup, total - warmup) / (total - warmup)
        decay = 0.5 * (1 + math.cos(math.pi * p)) if shape == "cosine" else 1 - p
        return floor + (1 - floor) * decay

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    rates = []
    for _ in range(total + 5):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


@pytest.mark.parametrize("shape", ["cosine", "linear"])
def test_warmup_then_decay_to_a_floor_is_torchs_recipe_step_by_step(shape):
    cfg = OptimizerConfig("adamw", lr=0.3, schedule=shape, total_steps=100, warmup=20, floor=0.1)
    expected = _torch_rates(20, 100, 0.1, shape)
    got = [cfg.lr_at(i) for i in range(len(expected))]
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[0] == pytest.approx(0.3 / 20) and got[19] == pytest.approx(0.3)
    assert got[100:] == pytest.approx([0.03] * 5)  # the floor after the total


def test_warmup_then_constant_and_the_old_cosine_unchanged():
    warm = OptimizerConfig("sgd", lr=1.0, warmup=4)
    assert [warm.lr_at(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = OptimizerConfig("sgd", lr=1.0, schedule="cosine", total_steps=10)
    assert [cosine.lr_at(i) for i in range(11)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * i / 10)) for i in range(11)]
    )


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"schedule": "linear"}, "--lr-schedule linear needs --lr-total-steps"),
        ({"schedule": "cosine", "total_steps": 10, "warmup": 10}, "leaves nothing"),
        ({"floor": 1.5}, "--lr-floor is a fraction"),
        ({"floor": -0.1}, "--lr-floor is a fraction"),
        ({"warmup": -1}, "--lr-warmup"),
    ],
)
def test_a_schedule_that_cannot_be_is_refused_naming_the_option(kwargs, says):
    with pytest.raises(ConfigError, match=says):
        OptimizerConfig("adamw", lr=0.1, **kwargs)


def test_the_servers_steps_take_the_schedules_rate():
    import numpy as np

    from paramserver.codec.layout import Manifest
    from paramserver.server.bookkeeping.store import ParameterStore

    manifest = Manifest.from_tensors([("w", torch.zeros(3))])
    cfg = OptimizerConfig("sgd", lr=1.0, schedule="linear", total_steps=6, warmup=2, floor=0.5)
    store = ParameterStore(manifest, np.zeros(3, np.float32), cfg)
    moved = []
    for _ in range(7):
        before = store.weights[0]
        store.apply(np.ones(3, np.float32))
        moved.append(float(before - store.weights[0]))
    assert moved == pytest.approx([0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5])


def _store(schedule: str, **kw):
    import numpy as np

    from paramserver.codec.layout import Manifest
    from paramserver.server.bookkeeping.store import ParameterStore

    manifest = Manifest.from_tensors([("w", torch.zeros(3))])
    cfg = OptimizerConfig("sgd", lr=0.3, schedule=schedule, **kw)
    return ParameterStore(manifest, np.zeros(3, np.float32), cfg)


def test_a_users_scheduler_factory_gives_the_servers_rate_at_each_step():
    """Issue 56, must 3: ``--lr-schedule module:function``, stepped once a server step;
    every shard (another store) and a rewind (an earlier step asked again) agree."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    want = []
    for _ in range(12):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    a, b = _store("tests.user_schedules:step_lr"), _store("tests.user_schedules:step_lr")
    assert [a.rate(i) for i in range(12)] == pytest.approx(want)
    assert [b.rate(i) for i in reversed(range(12))] == pytest.approx(want[::-1])
    assert a.rate(4) == pytest.approx(0.15)  # asked again, after step 11
    lambda_lr = _store("tests.user_schedules:warmup_cosine")
    built_in = OptimizerConfig(
        "sgd", lr=0.3, schedule="cosine", total_steps=100, warmup=20, floor=0.1
    )
    assert [lambda_lr.rate(i) for i in range(110)] == pytest.approx(
        [built_in.lr_at(i) for i in range(110)], rel=1e-12
    )


@pytest.mark.parametrize(
    "schedule, says",
    [
        ("tests.user_schedules:not_a_scheduler", "returned int, not a torch.optim.lr_scheduler"),
        ("tests.user_schedules:broken", "failed: RuntimeError"),
        ("tests.user_schedules:missing", "has no function 'missing'"),
    ],
)
def test_a_scheduler_factory_that_cannot_serve_is_refused_in_one_line(schedule, says):
    from paramserver.errors import ConfigError as Refused

    with pytest.raises(Refused, match=says) as err:
        _store(schedule)
    assert "\n" not in str(err.value)


def test_a_factory_takes_none_of_the_built_in_shapes():
    with pytest.raises(ConfigError, match="shape the built-in schedules only"):
        OptimizerConfig("sgd", lr=0.1, schedule="tests.user_schedules:step_lr", warmup=5)
    with pytest.raises(ConfigError, match="or module:function"):
        OptimizerConfig("sgd", lr=0.1, schedule="exponential")
