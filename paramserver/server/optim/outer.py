"""Delayed Nesterov: the outer optimizer for asynchronous local steps (Liu et al. 2024,
"Asynchronous Local-SGD Training for Language Modeling", arXiv 2401.09135, section 5.1).

Under ``async`` and ``ssp:K`` each worker's pseudo-gradient is applied as it arrives. With
Nesterov's momentum every stale pseudo-gradient also moves the momentum that the ones
before it built, and the run can diverge (measured here: 10.6% on Fashion-MNIST where
``sync`` reached 87.3%). Delayed Nesterov applies each pseudo-gradient at once at
``lr / N`` and moves the momentum only once every ``N`` of them (``N``: the workers), by
their mean, as a synchronous round of ``N`` workers would:

    every push g:            p -= lr / N * g;  pending += g
    every N-th push also:    m = momentum * m + pending / N;  p -= lr * momentum * m;
                             pending = 0

Under ``--coalesce on`` the pushes summed into one step count as one toward ``N`` (their
immediate part is the same as one at a time: the steps are linear in the sum).

With ``N`` = 1 this is torch's SGD with Nesterov momentum (``m = momentum * m + g``,
``p -= lr * (g + momentum * m)``). The paper's variant that also applies a share ``c`` of
the momentum between the N-th pushes is its ``c`` = 0 here, the form it reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class DelayedNesterov(torch.optim.Optimizer):
    """SGD with Delayed Nesterov momentum over ``period`` pushes (see the module).

    State per parameter: ``step`` (pushes applied, a float tensor as Adam's, so that
    resharding and export carry it as they carry Adam's), ``momentum_buffer`` and
    ``pending`` (the sum of the pushes since the momentum last moved), each per element.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        momentum: float = 0.9,
        period: int = 1,
        weight_decay: float = 0.0,
    ):
        if period < 1:
            raise ValueError(f"Delayed Nesterov's period must be at least 1; got {period}.")
        defaults = {"lr": lr, "momentum": momentum, "period": period, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, period = group["lr"], group["momentum"], group["period"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if group["weight_decay"]:
                    g = g.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["pending"] = torch.zeros_like(p)
                state["step"] += 1
                pending, m = state["pending"], state["momentum_buffer"]
                pending.add_(g)
                p.add_(g, alpha=-lr / period)
                if int(state["step"].item()) % period == 0:
                    m.mul_(beta).add_(pending, alpha=1.0 / period)
                    pending.zero_()
                    p.add_(m, alpha=-lr * beta)
        return loss
