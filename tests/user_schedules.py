"""Learning-rate schedule factories as a user writes them, for ``--lr-schedule
tests.user_schedules:NAME``: each takes the optimizer and returns its scheduler."""

from __future__ import annotations

import torch

from tests import gpt


def warmup_cosine(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, gpt.warmup_cosine(20, 100, 0.1))


def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def not_a_scheduler(opt: torch.optim.Optimizer) -> int:
    return 1


def broken(opt: torch.optim.Optimizer) -> None:
    raise RuntimeError("the schedule's file is not there")
