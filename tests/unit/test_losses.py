"""The built-in worker's loss and the server's evaluation of a sequence model (issue 56,
must 5): (B, T, V) logits against (B, T) targets are counted token by token, with the
perplexity; a user's ``--loss module:function`` is called as loss(outputs, targets). Before,
the evaluation divided token sums by sequences ("test accuracy 1849.19%") and the worker's
loss was fixed to cross_entropy(model(x), y)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from paramserver.errors import ConfigError
from paramserver.training import losses
from paramserver.training.evaluation import evaluate
from paramserver.training.figures import figures
from tests import gpt


def test_a_sequence_model_is_evaluated_token_by_token_with_its_perplexity():
    torch.manual_seed(0)
    model = gpt.gpt()
    x, y = gpt.text(40, seed=3)
    got = evaluate(model, x, y, batch=16)  # batches of 16, 16, 8 sequences
    with torch.no_grad():
        logits = model(x).reshape(-1, gpt.VOCAB)
    expected = F.cross_entropy(logits, y.reshape(-1)).item()
    assert got.loss == pytest.approx(expected, rel=1e-5)
    assert got.accuracy == pytest.approx((logits.argmax(1) == y.reshape(-1)).float().mean().item())
    assert 0.0 <= got.accuracy <= 1.0 and got.auc is None
    assert got.perplexity == pytest.approx(math.exp(expected), rel=1e-5)
    assert "perplexity" in figures(*got[:2], got.auc, got.perplexity)


def test_the_default_loss_takes_sequences_and_classes_alike():
    logits, targets = torch.randn(4, 5, 7), torch.randint(0, 7, (4, 5))
    flat = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    assert torch.equal(losses.resolve("")(logits, targets), flat)
    plain, labels = torch.randn(6, 3), torch.randint(0, 3, (6,))
    assert torch.equal(losses.cross_entropy(plain, labels), F.cross_entropy(plain, labels))


def test_a_users_loss_is_called_with_outputs_and_targets_and_evaluates_without_perplexity():
    fn = losses.resolve("tests.gpt:smoothed")
    assert fn is gpt.smoothed
    torch.manual_seed(0)
    model = gpt.gpt()
    x, y = gpt.text(8, seed=4)
    got = evaluate(model, x, y, loss=fn)
    with torch.no_grad():
        assert got.loss == pytest.approx(gpt.smoothed(model(x), y).item(), rel=1e-5)
    assert got.perplexity is None  # not a cross-entropy: no perplexity to speak of
    regression = evaluate(
        torch.nn.Linear(3, 1), torch.randn(8, 3), torch.randn(8, 1), loss=F.mse_loss
    )
    assert math.isnan(regression.accuracy)  # not classes: no accuracy
    assert "accuracy" not in figures(regression.accuracy, regression.loss)


@pytest.mark.parametrize(
    "spec, says",
    [
        ("tests.gpt:nothing", "has no function 'nothing'"),
        ("tests.gpt:gpt", "cannot be called with 2 arguments"),
        ("no_such_module_here:f", "Cannot import module 'no_such_module_here'"),
    ],
)
def test_a_loss_that_cannot_be_called_so_is_refused_in_one_line(spec, says):
    with pytest.raises(ConfigError, match=says) as err:
        losses.resolve(spec)
    assert "\n" not in str(err.value)
