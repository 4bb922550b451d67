"""``--compress int8`` end to end: the built-in worker takes local steps (DiLoCo: ``--push-every
4 --inner-optimizer sgd``) and pushes its pseudo-gradients in 8 bits with error feedback, over
the data port or gRPC streams (the int8 bytes) or a shared segment (quantised in place), and
the model it trains scores as one trained uncompressed."""

from __future__ import annotations

import pytest

from paramserver.codec import compression, layout
from paramserver.codec.compression import Int8
from paramserver.config import WorkerConfig
from paramserver.models import catalogue
from paramserver.training import data
from paramserver.training.evaluation import evaluate
from paramserver.training.trainer import run
from paramserver.transport import shm
from tests.conftest import WorkerThread

EPOCHS, BATCH, H = 3, 64, 4


def _train(serve, compress: str, path: str) -> tuple[float, dict]:
    """The test accuracy of the server's model after a run, and the server's status."""
    server = serve(
        "mlp",
        policy="async",
        workers=1,
        optimizer="nesterov",
        lr=0.7,
        momentum=0.9,
        dataset="synthetic",
        batch_size=BATCH,
        epochs=EPOCHS,
        seed=0,
    )
    cfg = WorkerConfig(
        server.address,
        device="cpu",
        push_every=H,
        inner_optimizer="sgd",
        inner_lr=0.02,
        compress=compress,
        shm="on" if path == "segment" else "off",
        wire="grpc" if path == "grpc" else "auto",
    )
    worker = WorkerThread(lambda: run(cfg), "w")
    worker.start()
    worker.result()
    c = server.coordinator
    model = catalogue.build("mlp")
    model.load_state_dict(layout.state_dict(c.manifest, c.store.weights), strict=True)
    ds = data.synthetic()
    return evaluate(model, ds.test_x, ds.test_y).accuracy, server.status()


@pytest.mark.parametrize(
    "path",
    [
        "data port",
        "grpc",
        pytest.param(
            "segment",
            marks=pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm here"),
        ),
    ],
)
def test_int8_pseudo_gradients_train_like_float32_ones(serve, path, monkeypatch):
    reference, _ = _train(serve, "none", path)
    quantised = []  # each push's int8 encoding (wire) or in-place rounding (segment)
    real = Int8._quantise
    monkeypatch.setattr(Int8, "_quantise", lambda c, *a: quantised.append(0) or real(c, *a))
    served = []
    monkeypatch.setattr(compression, "to_float32", _spy(compression.to_float32, served))
    accuracy, status = _train(serve, "int8", path)
    total = EPOCHS * data.batches_per_epoch(data.SYNTHETIC_TRAIN, BATCH)
    assert status["batches_applied"] == total and status["pushes_applied"] == total // H
    assert len(quantised) == total // H
    # streamed, the server decoded int8 payloads; a segment holds them decoded already
    assert served == ([] if path == "segment" else ["int8"] * (total // H))
    # measured: 0.9053 uncompressed, 0.9043 int8 (bf16: 0.9053); 3 epochs of 10 classes
    assert reference > 0.85, reference
    assert abs(accuracy - reference) < 0.02, (accuracy, reference)


def _spy(decode, seen: list[str]):
    def spied(raw, dtype, *args, **kwargs):
        seen.append(dtype)
        return decode(raw, dtype, *args, **kwargs)

    return spied
