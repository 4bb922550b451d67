"""The zoo's language model and its data (issue 58, must 3): ``gpt-tiny`` (``models/gpt.py``)
and ``--dataset text`` (``training/text.py``, this Python's standard library as bytes)."""

from __future__ import annotations

import math

import torch

from paramserver import models
from paramserver.config import MODEL_DEFAULTS
from paramserver.training import data, evaluation, losses, text


def test_gpt_tiny_is_a_causal_byte_model_with_its_head_tied():
    model = models.build("gpt-tiny", seed=0).eval()
    assert model.head.weight is model.tok.weight
    params = list(model.parameters())  # the tied tensor once
    assert sum(p.numel() for p in params) == 437_760
    x = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(x)
        later = x.clone()
        later[:, 40:] = (later[:, 40:] + 1) % 256  # change only the tokens from 40 on
        again = model(later)
    assert out.shape == (3, 64, 256)
    torch.testing.assert_close(out[:, :40], again[:, :40])  # no position sees ahead
    assert not torch.allclose(out[:, 40:], again[:, 40:])


def test_the_text_set_is_next_byte_windows_of_the_standard_library_split_at_the_end():
    raw = text.corpus()
    assert len(raw) >= text.CORPUS_BYTES and raw == text.corpus()  # whole files, the same
    ds = data.load("text")
    assert ds.train_size == data.train_size("text") == text.train_size()
    n = ds.train_size + len(ds.test_x)
    assert n == (len(raw) - 1) // 64 and len(ds.test_x) == int(n * text.TEST_SHARE)
    x, y = ds.batch(torch.tensor([0, 5]))
    assert x.shape == y.shape == (2, 64) and x.dtype == torch.int64
    assert bytes(x[1].tolist()) == raw[5 * 64 : 6 * 64]
    assert torch.equal(y[:, :-1], x[:, 1:])  # each target is the next byte
    assert bytes(ds.test_x[-1].tolist()) == raw[(n - 1) * 64 : n * 64]  # the test set last


def test_gpt_tiny_brings_its_data_and_evaluates_as_perplexity():
    assert MODEL_DEFAULTS["gpt-tiny"]["dataset"] == "text"  # launch --model gpt-tiny
    model = models.build("gpt-tiny", seed=0)
    ds = data.load("text")
    got = evaluation.evaluate(model, ds.test_x[:64], ds.test_y[:64], loss=None)
    assert 0 <= got.accuracy < 0.1  # next-byte accuracy, token by token: untrained ~1/256
    assert got.perplexity is not None and 200 < got.perplexity < 300  # untrained: ~256
    assert math.isclose(got.perplexity, math.exp(got.loss), rel_tol=1e-9)
    with torch.no_grad():
        loss = losses.resolve("")(model(ds.test_x[:4]), ds.test_y[:4])
    assert loss.shape == () and 5.0 < float(loss) < 6.0  # log 256 = 5.55
