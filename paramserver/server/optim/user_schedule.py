"""A user's learning-rate schedule (``--lr-schedule module:function``): the function takes
a torch optimizer and returns a ``torch.optim.lr_scheduler.LRScheduler`` over it, as users
write ``LambdaLR(opt, ...)`` or ``OneCycleLR(opt, ...)``. The server steps it once a step of
its own on a stand-in optimizer (one parameter at ``--lr``) and keeps each step's rate, so
the rate of step t is the same on every shard, for the tables, after a resume (the
schedule replayed from step 0) and after a rewind to an earlier step."""

from __future__ import annotations

import threading
from array import array

import torch

from paramserver.errors import ConfigError
from paramserver.models import import_function


class UserSchedule:
    """The rates the scheduler ``spec`` makes give an optimizer at ``lr``, step by step."""

    def __init__(self, spec: str, lr: float):
        make = import_function(spec, "lr-schedule", arguments=1)
        self._opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
        try:
            self._sched = make(self._opt)
        except Exception as exc:  # noqa: BLE001 - the user's code: one line, naming it
            raise ConfigError(f"--lr-schedule {spec!r} failed: {exc!r}.") from None
        if not isinstance(self._sched, torch.optim.lr_scheduler.LRScheduler):
            raise ConfigError(
                f"--lr-schedule {spec!r} returned {type(self._sched).__name__}, not a "
                "torch.optim.lr_scheduler.LRScheduler over the optimizer it was given."
            )
        self._rates = array("d", [self._opt.param_groups[0]["lr"]])
        self._lock = threading.Lock()  # pushes and pulls ask from several threads

    def lr_at(self, step: int) -> float:
        """The rate of optimizer step ``step`` (0-based): the scheduler's after ``step``
        steps."""
        with self._lock:
            while len(self._rates) <= step:
                self._opt.step()  # no gradient: only the order torch expects
                self._sched.step()
                self._rates.append(float(self._opt.param_groups[0]["lr"]))
            return self._rates[step]
