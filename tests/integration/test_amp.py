"""--amp on the built-in worker (training/precision.py, issue 46 item 7): bf16 and fp16
autocast train every batch of the run once; an fp16 step whose gradients overflow is not
pushed (its batches go back and are computed again, the scale halves); the weights and
what reaches the server stay float32."""

from __future__ import annotations

import pytest
import torch

from paramserver.config import WorkerConfig
from paramserver.errors import ConfigError
from paramserver.training import data, precision
from paramserver.training.precision import Precision
from paramserver.training.trainer import run
from tests.conftest import WorkerThread

EPOCHS, BATCH = 1, 64


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_every_batch_is_applied_once_under_amp(serve, monkeypatch, amp):
    overflowed: list[float] = []
    real = Precision.unscaled
    server = serve(
        "mlp", policy="async", workers=1, dataset="synthetic", batch_size=BATCH, epochs=EPOCHS
    )
    seen_dtypes: set[torch.dtype] = set()
    real_autocast = Precision.autocast

    def autocast(self):
        seen_dtypes.add(self.dtype)
        return real_autocast(self)

    monkeypatch.setattr(Precision, "autocast", autocast)
    if amp == "fp16":
        monkeypatch.setattr(Precision, "unscaled", _overflow_once(real, overflowed))
    cfg = WorkerConfig(server=server.address, device="cpu", amp=amp)
    worker = WorkerThread(lambda: run(cfg), "w")
    worker.start()
    summary = worker.result()
    status = server.status()
    total = EPOCHS * data.batches_per_epoch(data.SYNTHETIC_TRAIN, BATCH)
    assert status["batches_done"] == status["batches_applied"] == total, status
    assert summary.samples == status["samples"] == total * BATCH  # each batch pushed once
    assert seen_dtypes == {torch.bfloat16 if amp == "bf16" else torch.float16}
    weights = server.model_state_dict()
    assert all(t.dtype == torch.float32 for t in weights.values() if t.is_floating_point())
    if amp == "fp16":
        assert overflowed == [precision.INITIAL_SCALE]
        assert status["pushes_applied"] == total  # the skipped step pushed nothing


def _overflow_once(real, overflowed):
    def unscaled(self, params):
        params = list(params)
        if not overflowed:
            overflowed.append(self.scale)
            params[0].grad.fill_(float("inf"))
        return real(self, params)

    return unscaled


def test_the_loss_scale_halves_on_overflow_and_grows_after_clean_steps(monkeypatch):
    monkeypatch.setattr(precision, "GROWTH_INTERVAL", 3)
    p = torch.nn.Parameter(torch.zeros(4))
    amp = Precision("fp16", torch.device("cpu"))
    amp.backward((p * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum())
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0, 4.0]) * precision.INITIAL_SCALE)
    assert amp.unscaled([p]) and torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    p.grad.fill_(float("nan"))
    assert not amp.unscaled([p]) and amp.scale == precision.INITIAL_SCALE / 2
    assert amp.skipped == 1
    for _ in range(3):
        p.grad.fill_(1.0)
        assert amp.unscaled([p])
    assert amp.scale == precision.INITIAL_SCALE  # doubled after GROWTH_INTERVAL clean steps
    amp.scale = precision.MIN_SCALE
    p.grad.fill_(float("inf"))
    with pytest.raises(FloatingPointError, match="diverged"):
        amp.unscaled([p])
    plain = Precision("bf16", torch.device("cpu"))
    p.grad.fill_(float("inf"))
    assert plain.scale == 1.0 and plain.unscaled([p])  # bf16: no scale, nothing checked
    with pytest.raises(ValueError, match="--amp is one of off, bf16, fp16"):
        Precision("fp8", torch.device("cpu"))


def test_amp_is_refused_by_name():
    with pytest.raises(ConfigError, match="--amp must be one of off, bf16, fp16; got 'half'"):
        WorkerConfig(server="127.0.0.1:1", amp="half")


def test_fp16_is_refused_for_a_model_with_sparse_tables_bf16_trains_it(serve):
    """The row gradients of sparse tables are pushed as they come, never unscaled: fp16's
    loss scale would reach the rows. bf16 needs no scale."""
    server = serve(
        "tests.sparse_models:dlrm_sparse",
        policy="async",
        workers=1,
        dataset="clicks",
        batch_size=256,
        epochs=1,
    )
    with pytest.raises(ConfigError, match="use --amp bf16 .no scaling. for a model with sparse"):
        run(WorkerConfig(server.address, device="cpu", amp="fp16", max_steps=3))
    summary = run(WorkerConfig(server.address, device="cpu", amp="bf16", max_steps=3))
    assert summary.steps == 3 and server.status()["rows_pushed"] > 0
