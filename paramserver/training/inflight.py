"""Overlapped local steps: one exchange in flight behind the next H inner steps.

The user's replica trains while the ``Worker`` carries the exchange on a copy of it (the
*exchange replica*, ``worker.model``), on a thread of its own, so no inner step waits for
the network. A round ends (``send``): the pseudo-gradient (the round's anchor minus the
weights now) goes into the exchange replica's gradients, the weights now become the next
round's anchor, and ``worker.step`` pushes it and pulls the new global weights into the
exchange replica. The replica trains on meanwhile. When the pull has landed (``land``),
the new global weights G replace the anchor A the progress since the push is measured
from: the replica moves by G - A (it keeps every inner step taken meanwhile) and A := G.
So each inner step's progress is pushed exactly once, computed on weights one outer step
old: the delayed outer update (docs/guide.md says why this merge and not another).

At most one round is in flight: ``send`` lands the one before first. Only one thread
touches the worker at a time: the exchange's while a round is in flight, the caller's
once it has landed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn

from paramserver.errors import ConfigError

log = logging.getLogger(__name__)


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _frozen(model: nn.Module) -> list[torch.Tensor]:
    """What a pull sets and neither an inner step nor a forward pass changes."""
    return [p for p in model.parameters() if not p.requires_grad]


class _Call:
    """``fn`` on a daemon thread (a stuck exchange never holds the process at exit); its
    result or exception for ``result()``."""

    def __init__(self, fn: Callable[[], None]):
        self._done = threading.Event()
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - raised to the training thread
                self._error = exc
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name="ps-local-exchange", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def result(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


class Flight:
    """The exchange of ``exchange`` (the worker's model) behind ``model``'s inner steps.

    Args:
        step: the worker's step (push the exchange replica's gradients, pull into it).
        model: the replica the inner optimizer trains.
        exchange: the worker's model, a copy of ``model`` (same parameters, same order).
        anchor: where ``model``'s progress since the last push is measured from.
    """

    def __init__(
        self,
        step: Callable[..., None],
        model: nn.Module,
        exchange: nn.Module,
        anchor: Sequence[torch.Tensor],
    ):
        self.step = step
        self.params, self.anchor = trainable(model), list(anchor)
        self.sent = trainable(exchange)
        self.frozen = list(zip(_frozen(model), _frozen(exchange), strict=True))
        # buffers (BatchNorm's statistics) go out as values with the push, as the replica's:
        # each is merged like a parameter (kept: what the replica's forward passes added)
        self.buffers = list(model.buffers())
        self.sent_buffers = list(exchange.buffers())
        self.buffer_anchor = [b.detach().clone() for b in self.buffers]
        # (mine, its anchor, the exchange replica's): what a landing merges, a reset copies
        self.merged = list(
            zip(
                [*self.params, *self.buffers],
                [*self.anchor, *self.buffer_anchor],
                [*self.sent, *self.sent_buffers],
                strict=True,
            )
        )
        self._call: _Call | None = None
        self.rounds_merged = 0  # rounds landed and merged

    @property
    def in_flight(self) -> bool:
        return self._call is not None

    def send(self, samples: int, loss: float) -> None:
        """Land the round in flight, then push this one's pseudo-gradient from the
        background; ``model`` trains on from its weights now."""
        self.land()
        with torch.no_grad():
            for x, a, p in zip(self.sent, self.anchor, self.params, strict=True):
                if x.grad is None:
                    x.grad = a - p
                else:
                    torch.sub(a, p, out=x.grad)
                a.copy_(p)
            for b, x, a in zip(self.buffers, self.sent_buffers, self.buffer_anchor, strict=True):
                x.copy_(b)  # the push carries the replica's statistics
                a.copy_(b)
        self._call = _Call(lambda: self.step(samples=samples, loss=loss))

    def merge(self) -> bool:
        """Take the new global weights in if the round in flight has landed (never waits)."""
        if self._call is None or not self._call.done():
            return False
        self.land()
        return True

    def land(self) -> None:
        """Wait for the round in flight (if any) and merge what it pulled. A failure of its
        exchange is raised here, after the replica is set to the exchange replica's weights
        (what a blocking step would have left in the model)."""
        call, self._call = self._call, None
        if call is None:
            return
        try:
            call.result()
        except BaseException:
            self.reset()
            raise
        with torch.no_grad():
            for p, a, x in self.merged:
                p.add_(x - a)  # keep the progress made since the push
                a.copy_(x)
            self._copy_frozen()
        self.rounds_merged += 1

    def reset(self) -> None:
        """Drop the progress since the last push: the replica and its anchor := the
        exchange replica's weights (the global ones last pulled). Not while a round is in
        flight (its pull writes them).

        Raises:
            ConfigError: a round is in flight: ``land()`` first.
        """
        if self._call is not None:
            raise ConfigError("A round's exchange is in flight: land() it before anchoring.")
        with torch.no_grad():
            for p, a, x in self.merged:
                p.copy_(x)
                a.copy_(x)
            self._copy_frozen()

    def settle(self, timeout: float) -> None:
        """After a failure elsewhere: give the round in flight up to ``timeout`` seconds to
        end before the worker is closed under it; its own outcome is not asked for."""
        call, self._call = self._call, None
        if call is not None and not call.wait(timeout):
            log.warning("closing the worker with a round's exchange still in flight")

    def _copy_frozen(self) -> None:
        for mine, pulled in self.frozen:
            mine.copy_(pulled)
