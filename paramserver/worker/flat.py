"""``FlatReplica``: a model whose state lives in a few flat tensors on its device.

The default for a CUDA model (``Worker(flat=None)``). Every run of tensors in the manifest
with one role and one dtype (typically three: the parameters, the float buffers, the
integer buffers) becomes one flat tensor on the model's device, and each tensor a view of
it (``tensor.data``); the parameters' gradients are views of one flat gradient tensor a
run, as DDP's ``gradient_as_bucket_view`` makes them. So a push is one device-to-host copy
a run and shard range, a pull one host-to-device copy, with no model-sized allocation and
no copy per tensor.

Gradients leave the device as backward produces them: a hook on each parameter's gradient
accumulation counts the parameters of its bucket (about ``BUCKET_BYTES`` of consecutive
parameters, the last ones first, as backward reaches them); once every parameter of a
bucket has its gradient, the bucket is copied into the push slot ``early()`` gives (a free
one, or none yet) on the copies' own stream (``device_copies``). ``stage`` then copies only
what did not go early: a bucket whose parameters did not all get a gradient, or that got
more after its copy (gradients accumulated over several backward passes), or every bucket
when the slot is not the one the early copies went to. Zeroing is in place
(``flat_grad.zero_()``), so the views stay.

A model's tensors are the worker's while it runs: code that sets a gradient to None
(``optimizer.zero_grad()``) or replaces one is caught at the next stage (its values are
copied into the flat gradient and the view is restored), but a parameter whose ``.data`` is
replaced (``model.to()`` after joining) is no longer trained.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from paramserver.worker.device_copies import HostCopies, for_device
from paramserver.worker.replica import Replica

log = logging.getLogger(__name__)

BUCKET_BYTES = 8 << 20  # of gradients copied to the host at once during backward

Parts = Sequence[tuple[int, int, torch.Tensor]]


@dataclass(eq=False)
class Block:
    """Elements [lo, hi) of the flat buffer: one flat tensor on the device (``values``),
    and for parameters their gradients (``grads``)."""

    lo: int
    hi: int
    values: torch.Tensor
    grads: torch.Tensor | None
    members: range  # the indices of its tensors in the manifest
    version: int = -1  # ``grads._version`` after the last accumulation backward made


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients leave the device together: elements [lo, hi)."""

    lo: int
    hi: int
    block: Block
    members: list[int]  # the indices of its parameters in the manifest
    fires: int = 0  # gradient accumulations into its parameters this step
    copied_at: int = -1  # ``fires`` when it was copied early (-1: not copied)

    @property
    def params(self) -> int:
        return len(self.members)


def flat_blocks(manifest_tensors: Sequence[Any], tensors: Sequence[torch.Tensor]) -> list[Block]:
    """Each run of consecutive tensors with one role and dtype as one flat tensor on their
    device; every tensor becomes a view of its run's (parameters' gradients too)."""
    blocks: list[Block] = []
    i = 0
    while i < len(tensors):
        spec, t0 = manifest_tensors[i], tensors[i]
        j = i
        while (
            j < len(tensors)
            and manifest_tensors[j].role == spec.role
            and tensors[j].dtype == t0.dtype
            and tensors[j].device == t0.device
        ):
            j += 1
        run = tensors[i:j]
        lo, hi = spec.start, manifest_tensors[j - 1].start + manifest_tensors[j - 1].numel
        values = torch.empty(hi - lo, dtype=t0.dtype, device=t0.device)
        grads = torch.zeros_like(values) if spec.role == "param" else None
        with torch.no_grad():
            for s, t in zip(manifest_tensors[i:j], run, strict=True):
                a = s.start - lo
                view = values[a : a + s.numel].view(t.shape)
                view.copy_(t.detach())
                t.data = view
                if grads is not None:
                    t.grad = grads[a : a + s.numel].view(t.shape)
        blocks.append(Block(lo, hi, values, grads, range(i, j)))
        i = j
    return blocks


def _overlap(lo: int, hi: int, a: int, b: int) -> tuple[int, int]:
    return max(lo, a), min(hi, b)


class FlatReplica(Replica):
    """``model``'s state as flat tensors on its device (see the module's docstring)."""

    def __init__(
        self,
        model: nn.Module,
        copies: HostCopies | None = None,
        bucket_bytes: int = BUCKET_BYTES,
    ):
        super().__init__(model)
        self.copies = copies or for_device(self.device)
        self.blocks = flat_blocks(self.manifest.tensors, self.tensors)
        self.views: list[torch.Tensor] = [cast(torch.Tensor, p.grad) for p in self.params]
        self.buckets = self._buckets(bucket_bytes)
        # the push slot's buffers for early copies, asked for once a bucket is ready
        self.early: Callable[[], Parts | None] | None = None
        self._target: Parts | None = None
        self._got = [False] * len(self.params)  # a gradient accumulated this step, each
        self._hooks = [
            self.params[i].register_post_accumulate_grad_hook(self._hook(b, i))
            for b in self.buckets
            for i in b.members
        ]

    # --- layout ----------------------------------------------------------------------

    def _buckets(self, cap: int) -> list[Bucket]:
        """Consecutive parameters of about ``cap`` bytes a bucket, from the last one back
        (backward computes the last layers' gradients first)."""
        buckets: list[Bucket] = []
        specs = self.manifest.tensors
        for block in self.blocks:
            if block.grads is None:
                continue
            hi, size, members = block.hi, 0, []
            for i in reversed(block.members):
                size += specs[i].numel * block.grads.element_size()
                members.append(i)
                if size >= cap or i == block.members[0]:
                    buckets.append(Bucket(specs[i].start, hi, block, members))
                    hi, size, members = specs[i].start, 0, []
        return buckets

    # --- during backward -------------------------------------------------------------

    def _hook(self, bucket: Bucket, i: int) -> Callable[[torch.Tensor], None]:
        grads = bucket.block.grads
        assert grads is not None

        def fired(_: torch.Tensor) -> None:
            self._got[i] = True
            bucket.fires += 1
            bucket.block.version = grads._version  # an in-place change after backward moves it
            if bucket.fires == bucket.params and self.early is not None:
                self._copy_early(bucket)

        return fired

    def _copy_early(self, bucket: Bucket) -> None:
        """``bucket``'s gradients are all in: copy them to the push slot now, if it has
        one (never raises: ``stage`` copies what did not go)."""
        try:
            if self._target is None and self.early is not None:
                self._target = self.early()
            if self._target is None:
                return
            after = self.copies.ready()
            self._copy_grads(bucket, self._target, after)
            bucket.copied_at = bucket.fires
        except Exception:  # an error in a hook would abort the user's backward pass
            log.exception("copying a gradient bucket during backward failed; staging copies it")
            bucket.copied_at = -1

    def _copy_grads(self, bucket: Bucket, parts: Parts, after: Any) -> None:
        grads = bucket.block.grads
        assert grads is not None
        for lo, hi, buffer in parts:
            a, b = _overlap(lo, hi, bucket.lo, bucket.hi)
            if a < b:
                src = grads[a - bucket.block.lo : b - bucket.block.lo]
                self.copies.copy(buffer[a - lo : b - lo], src, after)

    # --- a step ----------------------------------------------------------------------

    def _restore_views(self) -> None:
        """Gradients set to None or replaced since the last step: their values into the
        flat gradients (zeros for None), and the views back."""
        grads = list(map(operator.attrgetter("grad"), self.params))
        if all(map(operator.is_, grads, self.views)):
            return
        with torch.no_grad():
            for p, g, view in zip(self.params, grads, self.views, strict=True):
                if g is view:
                    continue
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
                p.grad = view
        for b in self.buckets:  # copied early from the views, which did not hold them
            b.copied_at = -1

    def idle(self) -> list[tuple[int, int]]:
        """As ``Replica.idle``: the gradients are views that are never None, so a parameter
        has none when backward accumulated nothing into it this step and its gradient was
        set to None, or is still its view holding zeros (a gradient written in place, as a
        local step's pseudo-gradient is, counts: one check, a sync, for such parameters)."""
        specs = self.manifest.tensors
        maybe = [i for i, p in enumerate(self.params) if not self._got[i]]
        views = [i for i in maybe if self.params[i].grad is self.views[i]]
        written = torch.stack([self.views[i].any() for i in views]).tolist() if views else []
        nonzero = {i for i, w in zip(views, written, strict=True) if w}
        return [
            (specs[i].start, specs[i].start + specs[i].numel)
            for i in maybe
            if self.params[i].grad is None
            or (self.params[i].grad is self.views[i] and i not in nonzero)
        ]

    def stage(self, parts: Parts) -> None:
        """Copy the gradients, then the buffers' values, into each ``(lo, hi, buffer)``:
        one copy a run and range, none for the buckets that went early to these buffers."""
        self._restore_views()
        target = self._target
        same = target is not None and _same_buffers(target, parts)
        after = self.copies.ready()
        for bucket in self.buckets:
            # clipped, unscaled or otherwise changed in place after backward: copy again
            grads = bucket.block.grads
            unchanged = grads is not None and grads._version == bucket.block.version
            if not (same and unchanged and bucket.copied_at == bucket.fires):
                self._copy_grads(bucket, parts, after)
        for block in self.blocks:
            if block.grads is not None:
                continue
            for lo, hi, buffer in parts:
                a, b = _overlap(lo, hi, block.lo, block.hi)
                if a < b:
                    src = block.values[a - block.lo : b - block.lo]
                    self.copies.copy(buffer[a - lo : b - lo], src, after)
        self.copies.wait()

    def pieces(self, lo: int, hi: int, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """None: the gradients are zeroed in place after staging, so a push never sends
        from them."""
        return None

    def zero_grad(self) -> None:
        """Zero the flat gradients in place, once the copies reading them are done (copies
        of a step dropped or pushed empty were never waited for by ``stage``)."""
        if self._target is not None:
            self.copies.wait()
        self.copies.fence()
        for block in self.blocks:
            if block.grads is not None:
                block.grads.zero_()
        for b in self.buckets:
            b.fires, b.copied_at = 0, -1
        self._got = [False] * len(self.params)
        self._target = None

    def bind(self, parts: Parts) -> None:
        """Nothing: the tensors are views of the flat tensors already."""
        self.bound = 0

    def load(self, parts: Parts) -> None:
        """Copy each ``(lo, hi, buffer)`` of weights and buffers into the flat tensors it
        covers: one copy a run and range, after the compute enqueued so far."""
        after = self.copies.ready()
        for block in self.blocks:
            for lo, hi, buffer in parts:
                a, b = _overlap(lo, hi, block.lo, block.hi)
                if a < b:
                    dst = block.values[a - block.lo : b - block.lo]
                    self.copies.copy(dst, buffer[a - lo : b - lo], after)
        self.copies.wait()  # the buffer may be written again (a prefetch) once this returns
        self.copies.fence()

    def detach(self) -> None:
        """Remove the hooks (the worker closed; the model stays the caller's)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.early = None


def _same_buffers(a: Parts, b: Parts) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] == y[1] and x[2].data_ptr() == y[2].data_ptr()
        for x, y in zip(a, b, strict=True)
    )


def replica(model: nn.Module, flat: bool | None = None) -> Replica:
    """The replica of ``model``: flat (``FlatReplica``) if ``flat``, or (None) when the
    model is on a GPU; else the model's own tensors (``Replica``: a CPU model's pushes
    may be sent from its gradients, and blocking steps bind its tensors to the buffers)."""
    plain = Replica(model)
    devices = {t.device for t in plain.tensors}  # the run's state: not the tables' caches
    on_gpu = len(devices) == 1 and next(iter(devices)).type == "cuda"
    if not plain.params or not (on_gpu if flat is None else flat):
        return plain
    if len(devices) > 1:  # the copies follow one device's streams
        log.info("the model spans %s: its state stays per tensor", sorted(map(str, devices)))
        return plain
    return FlatReplica(model)
