"""Page-locked host memory for a CUDA worker's payloads.

A copy between a GPU and pageable memory goes through a driver staging buffer and blocks
the host (``non_blocking`` is ignored); from page-locked memory it runs at the bus's speed
and asynchronously (80 MB: 1.46 ms each way on an H100 host, against 6.1 ms to the host
and 11.1 ms to the device pageable). So a CUDA worker's payload buffers are page-locked:
the streams' and the data port's buffers are allocated so (``empty``), and a shared
segment, which the worker maps and the server reads, is registered with CUDA after mapping
(``Locker.register``: ``cudaHostRegister``, what ``torch.cuda.cudart()`` reaches), so the
GPU and the server read the same bytes with no staging copy.

Page-locking is a speed-up, never a condition: where it fails (no CUDA driver, a limit on
locked memory, a mapping the driver refuses) the buffer stays pageable, one warning is
logged and ``FALLBACKS`` counts it; the worker says whether its payloads are page-locked
(``Worker.page_locked``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


class _Fallbacks:
    """How many buffers stayed pageable because page-locking them failed (this process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self, what: str, why: object) -> None:
        with self._lock:
            self.count += 1
            n = self.count
        log.warning(
            "cannot page-lock %s (%s): it stays pageable, copies are slower (%d)", what, why, n
        )


FALLBACKS = _Fallbacks()


def empty(
    numel: int, dtype: torch.dtype, pin: bool, what: str = "a payload buffer"
) -> torch.Tensor:
    """An uninitialised host tensor, page-locked if ``pin`` and the driver allows it."""
    if pin:
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:  # no driver, or the locked-memory limit
            FALLBACKS.add(what, exc)
    return torch.empty(numel, dtype=dtype)


def cudart() -> Any:
    """torch's CUDA runtime bindings (``cudaHostRegister``, ``cudaHostUnregister``)."""
    return torch.cuda.cudart()


# cudaHostRegisterPortable: pinned for every CUDA context of the process (as torch does)
PORTABLE = 1


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error of this thread (``cudaGetLastError``), which a
    refused ``cudaHostRegister`` leaves set and torch's next kernel launch check would
    raise. torch's bindings lack the call: it is reached in the libcudart this process
    loaded; where none is found, a warning says what may follow."""
    for path in _loaded("libcudart"):
        try:
            ctypes.CDLL(path).cudaGetLastError()
            return
        except (OSError, AttributeError) as exc:
            log.debug("cudaGetLastError through %s failed: %s", path, exc)
    log.warning(
        "cannot clear the CUDA error the refused registration left; a CUDA call may report it"
    )


def _loaded(name: str) -> list[str]:
    """The paths of the shared libraries named ``name``* mapped into this process."""
    try:
        with open("/proc/self/maps") as maps:
            found = {line.split()[-1] for line in maps if name in line and "/" in line}
    except OSError:
        return []
    return sorted(p for p in found if p.rsplit("/", 1)[-1].startswith(name))


class Registration:
    """Host memory registered with CUDA; ``release`` unregisters it (before it is unmapped)."""

    def __init__(self, runtime: Any, address: int, nbytes: int):
        self._runtime, self.address, self.nbytes = runtime, address, nbytes
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            err = self._runtime.cudaHostUnregister(self.address)
        except Exception as exc:  # the runtime is gone at interpreter exit
            log.debug("cudaHostUnregister failed: %s", exc)
            return
        if int(err) != 0:
            log.debug("cudaHostUnregister answered %s", err)


class Locker:
    """Registers host memory with CUDA (``runtime``: torch's bindings; tests pass a fake)."""

    def __init__(
        self, runtime: Callable[[], Any] = cudart, clear: Callable[[], None] = clear_cuda_error
    ):
        self._runtime, self._clear = runtime, clear

    def register(self, memory: np.ndarray, what: str) -> Registration | None:
        """Page-lock ``memory`` (a mapped segment's bytes, kept mapped while registered);
        None, counted and logged once, where the driver refuses."""
        nbytes = memory.nbytes
        if nbytes == 0:
            return None
        address = memory.ctypes.data
        try:
            runtime = self._runtime()
            err = runtime.cudaHostRegister(address, nbytes, PORTABLE)
        except Exception as exc:  # no CUDA build, no driver
            FALLBACKS.add(what, exc)
            return None
        if int(err) != 0:
            self._clear()
            FALLBACKS.add(what, f"cudaHostRegister answered {err}")
            return None
        return Registration(runtime, address, nbytes)
