"""``--amp``: the built-in worker's forward and backward passes in mixed precision.

- ``bf16``: the forward pass under ``torch.autocast`` in bfloat16 (on CUDA and on CPU). Its
  exponent is float32's, so gradients need no scaling.
- ``fp16``: autocast in float16 with a dynamic loss scale, as ``torch.amp.GradScaler``
  does: the loss is multiplied by the scale before ``backward``, the gradients divided by
  it before the push. A step whose gradients overflow (inf or nan) is not pushed: the
  worker pushes an empty step (its batches go back to the server, to be computed again)
  and halves the scale; after ``GROWTH_INTERVAL`` clean steps the scale doubles.
- ``off``: float32 throughout.

The model's parameters, its gradients and the server's masters stay float32 whatever the
mode: autocast casts inside the operations, and a parameter's gradient has the
parameter's dtype. What is pushed is the float32 gradient (``--compress`` may round it on
the wire, as without ``--amp``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import torch

from paramserver.config import AMP_MODES

log = logging.getLogger(__name__)

MODES = AMP_MODES
INITIAL_SCALE = 2.0**16  # GradScaler's
GROWTH_INTERVAL = 2000  # clean steps before the scale doubles (GradScaler's)
MIN_SCALE = 2.0**-24  # below this the overflow is the model's, not the scale's


class Precision:
    """One worker's ``--amp`` mode on ``device``: ``autocast()`` around the forward pass,
    ``backward(loss)``, then ``unscaled(params)`` before the push."""

    def __init__(self, mode: str, device: torch.device):
        if mode not in MODES:
            raise ValueError(f"--amp is one of {', '.join(MODES)}; got {mode!r}.")
        self.mode, self.device = mode, device
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)
        self.scale = INITIAL_SCALE if mode == "fp16" else 1.0
        self.clean = 0  # steps since the scale last changed
        self.skipped = 0  # steps not pushed: their gradients overflowed

    def autocast(self) -> Any:
        """The context of a forward pass (and the loss): autocast, or nothing for off."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss scaled first under fp16."""
        (loss * self.scale if self.scale != 1.0 else loss).backward()

    def unscaled(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide the gradients by the scale (fp16); whether they are finite, i.e. the step
        may be pushed. An overflow halves the scale; a run of clean steps doubles it.

        Raises:
            FloatingPointError: the scale fell below ``MIN_SCALE``: the gradients are not
                finite at any scale (the model diverged).
        """
        if self.scale == 1.0 and self.mode != "fp16":
            return True
        grads = [p.grad for p in params if p.grad is not None]
        inverse = 1.0 / self.scale
        for g in grads:
            g.mul_(inverse)
        # one answer for all of them: a single wait for the device, not one a tensor
        finite = not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        if finite:
            self.clean += 1
            if self.clean >= GROWTH_INTERVAL:
                self.scale, self.clean = self.scale * 2.0, 0
            return True
        self.skipped += 1
        self.scale, self.clean = self.scale / 2.0, 0
        if self.scale < MIN_SCALE:
            raise FloatingPointError(
                f"--amp fp16: the gradients overflow at a loss scale of {self.scale:g}: the "
                "model diverged (try --amp bf16, or a smaller --lr)."
            )
        log.info(
            "--amp fp16: the step's gradients overflowed; not pushed, its batches go back "
            "(loss scale now %g, %d steps skipped)",
            self.scale,
            self.skipped,
        )
        return False
