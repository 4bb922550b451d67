"""Copies between a model's device and host payload buffers, in order with its compute.

``HostCopies`` (a CPU model) copies at once. ``CudaCopies`` runs them on a stream of its
own, so a gradient bucket leaves the GPU while backward computes the next one (as DDP's
bucketed all-reduce does) and a pull's weights land without a device-wide synchronise:

- ``ready()`` marks the point the compute stream has reached (an event); a copy ``after``
  it reads what the compute wrote before it;
- ``wait()`` blocks the host until every copy enqueued is done (before it reads a push's
  slot, or reuses a pull's buffer);
- ``fence()`` makes the compute wait for the copies (before it writes what a copy reads,
  zeroing the gradients, or reads what one wrote, the next forward pass).

The copies are correct from page-locked memory and from pageable memory alike; only page-
locked memory lets them run asynchronously (``transport/pinned.py``).
"""

from __future__ import annotations

from typing import Any

import torch


class HostCopies:
    """Copies on the host, done when the call returns (a CPU model)."""

    def ready(self) -> Any:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        dst.copy_(src)

    def wait(self) -> None:
        pass

    def fence(self) -> None:
        pass


class CudaCopies(HostCopies):
    """Copies on a side stream of ``device``, ordered against its current stream by events."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def ready(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            dst.copy_(src, non_blocking=True)

    def wait(self) -> None:
        self.stream.synchronize()

    def fence(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


def for_device(device: torch.device) -> HostCopies:
    return CudaCopies(device) if device.type == "cuda" else HostCopies()
