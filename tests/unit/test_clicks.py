"""The synthetic click log (``--dataset clicks``), AUC, and the DLRM model that reads it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver import models
from paramserver.training import clicks, data
from paramserver.training.evaluation import evaluate


def _pairwise_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.integers(0, 1)), min_size=2, max_size=40))
def test_auc_is_the_share_of_positive_negative_pairs_ranked_right(pairs):
    scores = np.array([s for s, _ in pairs], dtype=np.float64)
    labels = np.array([y for _, y in pairs])
    if labels.min() == labels.max():
        assert np.isnan(clicks.auc(scores, labels))
    else:
        assert clicks.auc(scores, labels) == pytest.approx(_pairwise_auc(scores, labels))


@pytest.mark.parametrize("rows", [2, 7, 1000, 1 << 20])
def test_ranks_map_to_ids_one_to_one(rows):
    ranks = np.arange(min(rows, 5000))
    ids = clicks.ids_of_ranks(ranks, field=3, rows=rows)
    assert ids.min() >= 0 and ids.max() < rows
    assert len(np.unique(ids)) == len(ranks)


def test_the_log_is_a_function_of_the_seed_with_zipf_ids_and_a_learnable_teacher():
    a = clicks.make(train=20_000, test=5_000, seed=3, rows=1000)
    b = clicks.make(train=20_000, test=5_000, seed=3, rows=1000)
    c = clicks.make(train=20_000, test=5_000, seed=4, rows=1000)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])
    train_x, train_y, test_x, test_y = a
    assert train_x.shape == (20_000, clicks.FIELDS) and train_x.dtype == torch.int64
    assert int(train_x.min()) >= 0 and int(train_x.max()) < 1000
    assert set(train_y.unique().tolist()) == {0, 1}
    # Zipf: the most popular id of a field is far more frequent than the median one
    counts = np.sort(np.bincount(train_x[:, 0].numpy(), minlength=1000))[::-1]
    assert counts[0] > 20 * max(1, counts[500])
    # the labels follow the teacher: its own logits rank the test clicks well
    teacher = clicks.teacher_logits(test_x.numpy(), seed=3)
    assert clicks.auc(teacher, test_y.numpy()) > 0.75
    assert 0.2 < float(train_y.float().mean()) < 0.8


def test_clicks_is_a_builtin_dataset():
    ds = data.load("clicks", seed=0)
    assert ds.train_size == data.train_size("clicks") == clicks.TRAIN
    x, y = ds.batch(torch.arange(5))
    assert x.shape == (5, clicks.FIELDS) and y.shape == (5,)


def test_dlrm_learns_the_click_log_and_reports_auc():
    torch.manual_seed(0)
    train_x, train_y, test_x, test_y = clicks.make(train=30_000, test=5_000, seed=0, rows=500)
    model = models.DLRM(clicks.FIELDS, 500)
    before = evaluate(model, test_x, test_y)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i in range(0, len(train_x), 256):
        loss = F.cross_entropy(model(train_x[i : i + 256]), train_y[i : i + 256])
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = evaluate(model, test_x, test_y)
    assert before.auc is not None and after.auc is not None
    assert after.auc > before.auc + 0.1 and after.auc > 0.7
    assert evaluate(models.mlp(), torch.zeros(4, 1, 28, 28), torch.zeros(4).long()).auc is None
