"""The local model's side of the flat buffer: its trainable parameters and buffers in
manifest order, copied into any ranges (the gradients and the buffers' values, for a push)
and out of them (the weights and the shared buffers, after a pull), one copy per element
whatever the number of shards."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from paramserver import models
from paramserver.codec.layout import flatten_into, spans, unflatten_into, views_of
from paramserver.errors import ConfigError


def sync(device: torch.device) -> None:
    """Wait for non-blocking copies to or from ``device`` to land."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Replica:
    """``model``'s parameters and buffers as the flat buffer ``manifest`` lays out."""

    def __init__(self, model: nn.Module):
        self.manifest, self.tensors = models.state(model)
        self.params = self.tensors[: sum(s.role == "param" for s in self.manifest.tensors)]
        # which parameters train, as the servers learnt it at the join (``check_trainable``)
        self._trains = [(n, p, p.requires_grad) for n, p in model.named_parameters()]
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.bound = 0  # tensors that are views of the weights' buffers (``bind``)

    def check_trainable(self) -> None:
        """Refuse a step once a parameter was frozen or unfrozen after the join: the servers
        carry the parameters that trained then, so an unfrozen one would never train and a
        frozen one would still be stepped (with zeros).

        Raises:
            ConfigError: naming the first such parameter.
        """
        for name, p, trained in self._trains:
            if p.requires_grad != trained:
                now = "unfrozen" if p.requires_grad else "frozen"
                raise ConfigError(
                    f"Parameter {name!r} was {now} after the worker joined; the servers train "
                    "the parameters that were trainable at the join. Set requires_grad before "
                    "the server and the worker are made (a run of its own for the new set)."
                )

    def idle(self) -> list[tuple[int, int]]:
        """The elements of the flat buffer of each parameter without a gradient now (None:
        backward did not reach it), sorted: the servers leave them alone, as torch's
        optimizers do."""
        specs = self.manifest.tensors
        return [
            (specs[i].start, specs[i].start + specs[i].numel)
            for i, p in enumerate(self.params)
            if p.grad is None
        ]

    def stage(self, parts: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Copy the gradients (zeros where a parameter has none), then the buffers' values,
        into each ``(lo, hi, buffer)``: elements [lo, hi) of the flat buffer."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        pushed = grads + self.tensors[len(grads) :]
        for lo, hi, buffer in parts:
            flatten_into(self.manifest, pushed, buffer, lo, hi)
        sync(self.device)

    def pieces(self, lo: int, hi: int, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """Elements [lo, hi) of what ``stage`` copies, as views of the gradients themselves
        (a push sends them from there: ``zero_grad`` drops the model's hold on them, so
        nothing writes them while they go) and copies of the buffers' values in ``dtype`` (the
        next forward pass changes those in place); None where a copy is needed anyway (a
        gradient of another dtype, not contiguous, or on a device)."""
        if self.device.type != "cpu":
            return None
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        values = [t.detach().to(dtype, copy=True) for t in self.tensors[len(grads) :]]
        return spans(self.manifest, grads + values, dtype, lo, hi)

    def detach(self) -> None:
        """Let go of the model (the worker closed): nothing to undo here."""

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def bind(self, parts: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Make each tensor that lies wholly in one ``(lo, hi, buffer)`` of received weights
        a view of it, its value copied there first: a pull then writes the model in place and
        ``load`` skips it. Only where nothing computes while a pull lands (blocking steps)."""
        self.bound = 0
        with torch.no_grad():
            for lo, hi, buffer in parts:
                for t, view in views_of(self.manifest, buffer, self.tensors, lo, hi):
                    view.copy_(t)
                    t.data = view
                    self.bound += 1

    def load(self, parts: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        """Copy each ``(lo, hi, buffer)`` of weights and buffers into the tensors it covers."""
        if self.bound == len(self.tensors):
            return  # every tensor is a view of its range's buffer: the pull wrote them
        for lo, hi, buffer in parts:
            unflatten_into(
                self.manifest, buffer.to(self.device, non_blocking=True), self.tensors, lo, hi
            )
        sync(self.device)
