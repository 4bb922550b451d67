"""Local steps with the server as the outer optimizer (DiLoCo: Douillard et al., 2023).

A worker trains its own replica for H steps with an inner optimizer (AdamW in DiLoCo),
then pushes one **pseudo-gradient**, the weights it pulled minus its weights now, and
pulls the new global weights. The server applies its own optimizer to it: SGD with
Nesterov momentum (``--optimizer nesterov --lr 0.7 --momentum 0.9``, DiLoCo's outer
step). Under ``sync`` the server averages a round's pseudo-gradients into one outer step,
as DiLoCo does; under ``ssp:K`` and ``async`` each is applied as it arrives.

``LocalSteps`` wraps a ``Worker`` in the user's own loop::

    local = ps.LocalSteps(worker)          # anchors the weights just pulled
    for i, (x, y) in enumerate(batches):
        loss_fn(model(x), y).backward()
        inner.step(); inner.zero_grad()
        if (i + 1) % H == 0:
            local.sync(samples=H * len(x))  # push the pseudo-gradient, pull, anchor again

The built-in worker does the same with ``--inner-optimizer adamw --push-every H`` (the
server hands out H batches a pull, each applied exactly once as a push of H batches).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from paramserver.config import lazy_dynamo
from paramserver.errors import ConfigError

if TYPE_CHECKING:
    from paramserver.worker.worker import Worker


class LocalSteps:
    """The weights ``worker`` last pulled, and the exchange of a pseudo-gradient."""

    def __init__(self, worker: Worker, inner: torch.optim.Optimizer | None = None):
        if worker.overlap:
            raise ConfigError(
                "Local steps need the pulled weights in the model when a step returns: "
                "use --overlap off (Worker(overlap=False))."
            )
        if worker.tables:
            raise ConfigError(
                "Local steps train a model's dense parameters; this model has sparse tables, "
                "whose rows the server applies as pushed: not supported yet."
            )
        self.worker = worker
        self.params = [p for p in worker.model.parameters() if p.requires_grad]
        self.anchor = [p.detach().clone() for p in self.params]
        self.inner = inner  # the inner optimizer, where the caller hands it over (trainer)
        # its step without torch's wrappers (``config/lazy_dynamo.py``): the trainer's loop
        self.inner_step = lazy_dynamo.stepper(inner) if inner is not None else None

    def into_grads(self) -> None:
        """Each parameter's gradient := the weights pulled minus the weights now."""
        with torch.no_grad():
            for p, pulled in zip(self.params, self.anchor, strict=True):
                if p.grad is None:
                    p.grad = pulled - p
                else:
                    torch.sub(pulled, p, out=p.grad)

    def anchored(self) -> None:
        """The weights just pulled are those the next pseudo-gradient is measured from."""
        with torch.no_grad():
            for p, pulled in zip(self.params, self.anchor, strict=True):
                pulled.copy_(p)

    def sync(self, samples: int = 0, loss: float = math.nan) -> None:
        """Push the pseudo-gradient of the steps since the last sync (``samples`` of
        them), pull the new global weights into the model, and anchor them."""
        self.into_grads()
        self.worker.step(samples=samples, loss=loss)
        self.anchored()
