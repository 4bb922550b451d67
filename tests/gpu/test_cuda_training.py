"""The built-in worker's newer paths on a real GPU: ``--amp bf16|fp16`` (autocast on CUDA, a
loss scale for fp16), local steps (``--inner-optimizer adamw`` over ``--push-every H``), and
a server's own evaluation after each epoch while its shard lives on the GPU.

Skipped where no GPU exists (CI has none: tests/integration covers the same paths on CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from paramserver.cluster.server_evaluation import plan
from paramserver.config import OptimizerConfig, ServerConfig, WorkerConfig
from paramserver.training import data
from paramserver.training.precision import Precision
from paramserver.training.trainer import run
from tests.conftest import DEADLINE, WorkerThread

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: tests/gpu runs on a GPU host"
)

BATCH = 64
TOTAL = data.batches_per_epoch(data.SYNTHETIC_TRAIN, BATCH)  # one epoch


def _server(serve, **kw):
    kw.setdefault("policy", "async")
    kw.setdefault("workers", 1)
    return serve("mlp", dataset="synthetic", batch_size=BATCH, epochs=1, **kw)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_on_cuda_applies_every_batch_once_with_float32_masters(serve, monkeypatch, amp):
    seen: set[tuple[str, torch.dtype]] = set()
    real = Precision.autocast

    def autocast(self):
        seen.add((self.device.type, self.dtype))
        return real(self)

    monkeypatch.setattr(Precision, "autocast", autocast)
    server = _server(serve)
    summary = run(WorkerConfig(server=server.address, device="cuda", amp=amp))
    status = server.status()
    assert status["batches_done"] == status["batches_applied"] == TOTAL, status
    assert summary.samples == status["samples"] == TOTAL * BATCH
    want = torch.bfloat16 if amp == "bf16" else torch.float16
    assert seen == {("cuda", want)}
    weights = server.model_state_dict()
    assert all(t.dtype == torch.float32 for t in weights.values() if t.is_floating_point())
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


def test_local_steps_on_cuda_apply_every_batch_once(serve):
    server = _server(serve, optimizer="nesterov", lr=0.7, momentum=0.9)
    cfg = WorkerConfig(
        server=server.address,
        device="cuda",
        push_every=4,
        inner_optimizer="adamw",
        inner_lr=1e-3,
        overlap="off",
    )
    summary = run(cfg)
    status = server.status()
    assert status["batches_done"] == status["batches_applied"] == TOTAL, status
    assert summary.samples == TOTAL * BATCH
    assert status["pushes_applied"] == -(-TOTAL // 4)  # one pseudo-gradient per 4 batches
    assert 0 < status["train_loss"] < 2.3  # below chance's log(10)


def test_a_gpu_shard_evaluates_its_model_after_each_epoch(serve, tmp_path):
    cfg = ServerConfig(
        model="mlp",
        dataset="synthetic",
        batch_size=BATCH,
        epochs=2,
        policy="async",
        workers=1,
        server_device="cuda",
        optimizer=OptimizerConfig("adam", lr=1e-3),
        host="127.0.0.1",
        port=0,
    )
    planned = plan(cfg, str(tmp_path / "run"), None)
    assert planned is not None
    server = serve("mlp", config=cfg)
    evaluation = planned.start(server)
    worker = WorkerThread(lambda: run(WorkerConfig(server=server.address, device="cuda")), "w")
    worker.start()
    worker.result()
    assert evaluation.finished.wait(DEADLINE)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2] and lines[-1]["test_accuracy"] > 0.5
    assert server.status()["tested_epoch"] == 2


@pytest.mark.parametrize("compress", ["int8", "bf16"])
def test_compressed_pseudo_gradients_from_a_cuda_worker(serve, compress):
    """int8, and bf16 with its error feedback, from a CUDA worker's staged gradients."""
    server = _server(serve, optimizer="nesterov", lr=0.7, momentum=0.9)
    cfg = WorkerConfig(
        server=server.address,
        device="cuda",
        compress=compress,
        push_every=4,
        inner_optimizer="sgd",
        inner_lr=0.05,
    )
    summary = run(cfg)
    status = server.status()
    assert status["batches_done"] == status["batches_applied"] == TOTAL, status
    assert summary.samples == TOTAL * BATCH
    assert 0 < status["train_loss"] < 2.3
