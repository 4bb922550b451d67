"""Page-locking a CUDA worker's payload buffers (``transport/pinned.py``), with a fake CUDA
runtime: registration, release before unmapping, and a counted, logged fallback."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from paramserver.transport import pinned
from paramserver.transport import shm as shmem
from paramserver.transport.shm_channel import ShmChannel


class FakeRuntime:
    """What ``torch.cuda.cudart()`` answers, recording the calls."""

    def __init__(self, register_error: int = 0):
        self.register_error = register_error
        self.calls: list[tuple] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", address, nbytes, flags))
        return self.register_error

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        self.calls.append(("unregister", address))
        return 0


def test_a_segment_is_registered_whole_and_released_before_it_is_unmapped():
    runtime = FakeRuntime()
    segment = shmem.Segment(1 << 16, 2, rows_bytes=0)
    memory = segment.memory
    address, nbytes = memory.ctypes.data, memory.nbytes
    channel = ShmChannel(
        SimpleNamespace(), segment, pin=True, locker=pinned.Locker(lambda: runtime)
    )
    assert channel.page_locked and "(page-locked)" in channel.description
    assert runtime.calls == [("register", address, nbytes, pinned.PORTABLE)]
    order: list[str] = []
    close = segment.close
    segment.close = lambda: (order.append("unmap"), close())  # type: ignore[method-assign]
    real = runtime.cudaHostUnregister
    runtime.cudaHostUnregister = lambda a: (order.append("unregister"), real(a))[1]  # type: ignore[method-assign]
    channel.close()
    assert order == ["unregister", "unmap"]
    assert runtime.calls[-1] == ("unregister", address)


def test_an_unpinned_channel_registers_nothing():
    runtime = FakeRuntime()
    segment = shmem.Segment(1 << 12, 1)
    channel = ShmChannel(SimpleNamespace(), segment, locker=pinned.Locker(lambda: runtime))
    assert not channel.page_locked and runtime.calls == []
    channel.close()


def test_a_refused_registration_is_a_counted_logged_fallback(caplog):
    before = pinned.FALLBACKS.count
    segment = shmem.Segment(1 << 12, 1)
    cleared: list[int] = []
    locker = pinned.Locker(lambda: FakeRuntime(2), clear=lambda: cleared.append(1))
    with caplog.at_level(logging.WARNING):
        channel = ShmChannel(SimpleNamespace(), segment, pin=True, locker=locker)
    assert not channel.page_locked
    assert cleared == [1]  # the error it left is not raised by the next kernel launch
    assert pinned.FALLBACKS.count == before + 1
    assert "cannot page-lock the shared segment" in caplog.text
    assert "cudaHostRegister answered 2" in caplog.text
    # the payloads still work: the views are the segment's
    channel.weights.fill_(1.5)
    assert float(segment.weights[0]) == 1.5
    channel.close()


def test_no_cuda_runtime_is_a_fallback_never_an_error():
    def no_runtime() -> object:
        raise AssertionError("Torch not compiled with CUDA enabled")

    before = pinned.FALLBACKS.count
    assert pinned.Locker(no_runtime).register(shmem.Segment(4096, 1).memory, "x") is None
    assert pinned.FALLBACKS.count == before + 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host pins for real")
def test_a_pinned_buffer_without_cuda_is_pageable_and_counted(caplog):
    before = pinned.FALLBACKS.count
    with caplog.at_level(logging.WARNING):
        t = pinned.empty(16, torch.float32, pin=True)
    assert t.numel() == 16 and not t.is_pinned()
    assert pinned.FALLBACKS.count == before + 1
    assert pinned.empty(16, torch.float32, pin=False).numel() == 16
    assert pinned.FALLBACKS.count == before + 1


def test_release_is_once_and_survives_a_dead_runtime():
    runtime = FakeRuntime()
    reg = pinned.Registration(runtime, 1234, 10)
    reg.release()
    reg.release()
    assert runtime.calls == [("unregister", 1234)]

    class Gone:
        def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
            raise RuntimeError("driver shutting down")

    pinned.Registration(Gone(), 1, 1).release()  # no exception


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host pins for real")
def test_a_cuda_workers_stream_buffers_fall_back_to_pageable_memory():
    from paramserver.transport.channels import StreamBuffers

    before = pinned.FALLBACKS.count
    buffers = StreamBuffers(64, 2, torch.device("cuda"))
    assert buffers.pinned
    weights, slots = buffers.views(8, 40)
    assert weights.numel() == 32 and [s.numel() for s in slots] == [32, 32]
    assert pinned.FALLBACKS.count == before + 3  # the receive buffer and two slots


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host has a libcudart to call")
def test_clearing_the_cuda_error_without_a_cuda_runtime_only_warns(caplog):
    with caplog.at_level(logging.WARNING):
        pinned.clear_cuda_error()  # no libcudart in this CPU-only process
    assert "cannot clear the CUDA error" in caplog.text
    assert pinned._loaded("libc.so") or pinned._loaded("libc-")  # the maps are read
