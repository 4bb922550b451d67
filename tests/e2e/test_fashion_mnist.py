"""The real thing: `paramserver launch` on Fashion-MNIST, 2 workers, delay-1, MLP, 1 epoch, CPU."""

from __future__ import annotations

import json
import os

import pytest
import torch

from paramserver import models
from paramserver.training import data
from tests.conftest import launch_json


@pytest.mark.slow
def test_one_epoch_of_fashion_mnist_reaches_84_percent(tmp_path):
    try:
        data.load_idx_folder()
    except data.DataUnavailable as exc:  # say exactly what is missing, do not skip silently
        pytest.fail(f"{exc} (`make install` installs it as root)")
    summary, _ = launch_json(
        tmp_path,
        *("--workers", "2", "--policy", "delay-1", "--model", "mlp", "--epochs", "1"),
    )
    print(json.dumps(summary))
    assert summary["test_accuracy"] >= 0.84, summary
    assert summary["max_staleness"] <= 1
    run_dir = tmp_path / os.path.basename(summary["run_dir"])
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    model = models.build("mlp")
    model.load_state_dict(ckpt["model_state_dict"])
    assert ckpt["version"] == summary["version"]
