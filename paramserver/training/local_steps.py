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

``LocalSteps(worker, overlap=True)`` (``--overlap on``) puts the exchange behind the next H
inner steps (``inflight.py``): you train ``local.model``, a copy of the worker's model (build
the inner optimizer on its parameters), ``sync`` returns at once, ``merge()`` takes the new
global weights in as soon as they land (call it after inner steps; ``sync`` does in any case),
and ``close()`` lands the last round and closes the worker (or ``with ps.LocalSteps(...) as
local:``, which does; close the worker through it, not on its own, while a round may fly).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from paramserver.config import lazy_dynamo
from paramserver.errors import ConfigError
from paramserver.training.inflight import Flight, trainable

if TYPE_CHECKING:
    from paramserver.worker.worker import Worker


SETTLE_SECONDS = 60.0  # a failed loop's wait for the round in flight before closing


class LocalSteps:
    """The weights ``worker`` last pulled, and the exchange of a pseudo-gradient.

    Args:
        worker: a ``Worker`` with ``overlap=False``.
        inner: the inner optimizer, where the caller hands it over (the trainer; ``use``).
        overlap: the exchange in the background, behind the next inner steps, on a copy of
            the worker's model; the replica trained is then ``model`` (``inflight.py``).
    """

    def __init__(
        self, worker: Worker, inner: torch.optim.Optimizer | None = None, overlap: bool = False
    ):
        if worker.overlap:
            raise ConfigError(
                "Local steps need the pulled weights in the model when a step returns: "
                "use --overlap off (Worker(overlap=False)); LocalSteps(worker, overlap=True) "
                "overlaps the exchange with the inner steps instead."
            )
        if worker.tables:
            raise ConfigError(
                "Local steps train a model's dense parameters; this model has sparse tables, "
                "whose rows the server applies as pushed: not supported yet."
            )
        self.worker = worker
        # the replica the inner steps train: the worker's model, or with overlap a copy of
        # it (tied weights stay tied), while the worker's carries the exchange
        self.model = copy.deepcopy(worker.model) if overlap else worker.model
        self.params = trainable(self.model)
        self.anchor = [p.detach().clone() for p in self.params]
        self.flight = (
            Flight(worker.step, self.model, worker.model, self.anchor) if overlap else None
        )
        self.inner: torch.optim.Optimizer | None = None
        self.inner_step: Callable[[], object] | None = None
        self.use(inner)

    def use(self, inner: torch.optim.Optimizer | None) -> None:
        """The inner optimizer over ``params``: its step without torch's wrappers
        (``config/lazy_dynamo.py``), for the trainer's loop."""
        self.inner = inner
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
        if self.flight is not None:
            self.flight.reset()  # the worker's model holds them
            return
        with torch.no_grad():
            for p, pulled in zip(self.params, self.anchor, strict=True):
                pulled.copy_(p)

    def sync(self, samples: int = 0, loss: float = math.nan) -> None:
        """Push the pseudo-gradient of the steps since the last sync (``samples`` of
        them), pull the new global weights into the model, and anchor them. With overlap:
        land the round before, then push this one from the background and return."""
        if self.flight is not None:
            self.flight.send(samples, loss)
            return
        self.into_grads()
        self.worker.step(samples=samples, loss=loss)
        self.anchored()

    def merge(self) -> bool:
        """With overlap: take the new global weights in if they have landed, keeping the
        inner steps taken since the push; never waits. Whether it did."""
        return self.flight is not None and self.flight.merge()

    def land(self) -> None:
        """With overlap: wait for the round in flight and take its weights in."""
        if self.flight is not None:
            self.flight.land()

    def close(self) -> None:
        """Land the round in flight, then close the worker (``Worker.close``)."""
        try:
            self.land()
        finally:
            self.worker.close()

    def __enter__(self) -> LocalSteps:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        """``close()``; after an exception, the round in flight (if any) gets up to a minute
        to end before the worker is closed without waiting for its pushes."""
        if kind is None:
            self.close()
            return
        if self.flight is not None:
            self.flight.settle(SETTLE_SECONDS)
        self.worker.close_quietly()
