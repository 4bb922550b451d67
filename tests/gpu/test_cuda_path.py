"""The CUDA path on a real GPU: flat-buffer views, a page-locked segment, a 64 MiB push and
pull, sync equivalence with a CUDA worker and a launch of 2 CUDA workers.

Skipped where no GPU exists (CI has none; the unit suite runs every CUDA branch on CPU with
fakes). On a GPU host: ``python -m pytest tests/gpu -q`` (``../shared/gpu/README.md`` says
how to carry what the device image lacks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from paramserver.transport import pinned
from paramserver.transport import shm as shmem
from paramserver.transport.shm_channel import ShmChannel
from paramserver.worker.flat import FlatReplica
from paramserver.worker.replica import Replica
from tests.conftest import assert_same_state, local_sgd

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: tests/gpu runs on a GPU host"
)

CUDA = torch.device("cuda")


def mlp(width: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 10)
    )


def batch(step: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    return x.to(CUDA), y.to(CUDA)


def test_flat_views_on_the_device_stage_what_the_per_tensor_path_stages():
    plain, flat = mlp().to(CUDA), mlp().to(CUDA)
    r = FlatReplica(flat)
    assert type(r.copies).__name__ == "CudaCopies"
    for p in r.params:
        assert p.grad is not None and p.grad.device.type == "cuda"
    x, y = batch(0)
    F.cross_entropy(plain(x), y).backward()
    F.cross_entropy(flat(x), y).backward()
    n = r.manifest.numel
    want, got = torch.empty(n, pin_memory=True), torch.empty(n, pin_memory=True)
    Replica(plain).stage([(0, n, want)])
    r.stage([(0, n // 3, got[: n // 3]), (n // 3, n, got[n // 3 :])])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_page_locked_segment_round_trip():
    segment = shmem.Segment(16 << 20, 2)
    before = pinned.FALLBACKS.count
    channel = ShmChannel(object(), segment, pin=True)  # type: ignore[arg-type]
    try:
        assert channel.page_locked, "cudaHostRegister refused the segment (see the log)"
        assert pinned.FALLBACKS.count == before
        assert channel.slots[0].is_pinned() and channel.weights.is_pinned()
        src = torch.arange(channel.slots[0].numel(), device=CUDA, dtype=torch.float32)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            channel.slots[0].copy_(src, non_blocking=True)
        stream.synchronize()
        assert float(segment.slots[0][-1]) == float(src[-1])
        back = torch.empty_like(src)
        back.copy_(channel.slots[0], non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, src)
    finally:
        channel.close()


def test_a_64_mib_push_and_pull(serve):
    torch.manual_seed(0)
    model = nn.Linear(4096, 4096, bias=False)  # 16M parameters: 64 MiB of float32
    server = serve(model, optimizer="sgd", lr=0.5, policy="sync", workers=1)
    local = nn.Linear(4096, 4096, bias=False).to(CUDA)
    with ps.Worker(server.address, local) as w:
        assert w.shm_active and w.page_locked
        assert isinstance(w._replica, FlatReplica)
        start = local.weight.detach().clone()
        local.weight.grad = torch.full_like(local.weight, 2.0)  # replaced: copied back in
        w.step()  # sync: the pull after the push waits for its round
        torch.testing.assert_close(local.weight, start - 1.0, rtol=0, atol=1e-6)
    weights = torch.from_numpy(server.coordinator.store.weights.copy()).view(4096, 4096)
    torch.testing.assert_close(weights, local.weight.detach().cpu(), rtol=0, atol=0)


def test_one_cuda_sync_worker_takes_the_steps_of_local_sgd(serve):
    model = mlp()
    server = serve(mlp(), optimizer="sgd", lr=0.1, policy="sync", workers=1)
    local = mlp().to(CUDA)
    with ps.Worker(server.address, local) as w:
        assert w.overlap and isinstance(w._replica, FlatReplica)
        for step in range(20):
            x, y = batch(step)
            F.cross_entropy(local(x), y).backward()
            w.step(samples=len(x))
    assert_same_state(local, local_sgd(model.to(CUDA), batch, 20, 0.1), rtol=1e-6, atol=1e-7)


def test_a_launch_of_two_cuda_workers(tmp_path):
    args = [sys.executable, "-m", "paramserver", "launch", "--device", "cuda", "--workers", "2"]
    args += ["--dataset", "synthetic", "--epochs", "2", "--policy", "sync", "--json"]
    args += ["--no-progress", "--runs-dir", str(tmp_path)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workers"] == 2 and summary["test_accuracy"] > 0.2, summary


def test_a_refused_registration_leaves_no_cuda_error_behind():
    segment = shmem.Segment(1 << 20, 1)
    first = pinned.Locker().register(segment.memory, "the segment")
    try:
        assert first is not None
        assert pinned.Locker().register(segment.memory, "the segment again") is None  # refused
        assert float(torch.ones(4, device=CUDA).sum()) == 4.0  # a kernel launch after it
    finally:
        if first is not None:
            first.release()
        segment.close()
