"""The local model's side of the flat buffer: its trainable parameters in manifest order,
copied into any ranges (the gradients, for a push) and out of them (the weights, after a
pull), one copy per element whatever the number of shards."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from paramserver import models
from paramserver.codec.layout import Manifest, flatten_into, unflatten_into


def sync(device: torch.device) -> None:
    """Wait for non-blocking copies to or from ``device`` to land."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Replica:
    """``model``'s parameters as the flat buffer ``manifest`` lays out."""

    def __init__(self, model: nn.Module):
        named = models.parameters(model)
        self.params = [p for _, p in named]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.manifest = Manifest.from_tensors(named)

    def stage(self, parts: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Copy the gradients (zeros where a parameter has none) into each ``(lo, hi,
        buffer)``: elements [lo, hi) of the flat buffer."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        for lo, hi, buffer in parts:
            flatten_into(self.manifest, grads, buffer, lo, hi)
        sync(self.device)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def load(self, parts: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Copy each ``(lo, hi, buffer)`` of weights into the parameters it covers."""
        for lo, hi, buffer in parts:
            unflatten_into(self.manifest, buffer.to(self.device, non_blocking=True),
                           self.params, lo, hi)  # fmt: skip
        sync(self.device)
