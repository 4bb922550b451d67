"""A sequence model on the built-in worker (issue 56, must 5): ``launch`` of a user's GPT on
(B, T) token batches trains with the default token cross-entropy and reports per-token
accuracy, loss and perplexity; ``--loss module:function`` trains with the user's loss
instead. Before, the worker's cross_entropy(model(x), y) failed on (B, T, V) logits."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import cli

ARGS = ["--model", "tests.gpt:gpt", "--dataset", "tests.gpt:dataset", "--workers", "2"]
ARGS += ["--epochs", "1", "--batch-size", "32", "--optimizer", "adam", "--lr", "0.003"]


@pytest.mark.parametrize("loss", ["", "tests.gpt:smoothed"], ids=["token-cross-entropy", "own"])
def test_a_gpt_trains_on_the_built_in_workers_and_is_evaluated_per_token(tmp_path, loss):
    own = ["--loss", loss] if loss else []
    done = cli("launch", *ARGS, *own, "--json", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0.0 <= summary["test_accuracy"] <= 1.0  # per token, not token sums per sequence
    assert summary["samples"] == 512 and not summary["failed_workers"]
    assert 0.0 < summary["test_loss"] < math.log(32) + 0.5
    if loss:
        assert "test_perplexity" not in summary  # not a cross-entropy
    else:
        assert summary["test_perplexity"] == pytest.approx(math.exp(summary["test_loss"]))
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["test_loss"] == summary["test_loss"]
