"""Device choice, exercised without a GPU: the CUDA branches run against a patched torch.cuda."""

from __future__ import annotations

import pytest
import torch

from paramserver.errors import ConfigError
from paramserver.training import trainer
from paramserver.worker import replica


@pytest.mark.parametrize(
    "spec,procs,gpus,expected",
    [
        ("auto", 3, 0, ["auto", "auto", "auto"]),
        ("auto", 4, 2, ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]),
        ("cuda", 2, 2, ["cuda:0", "cuda:1"]),
        ("cuda:1", 2, 2, ["cuda:1", "cuda:1"]),
        ("cpu", 2, 8, ["cpu", "cpu"]),
    ],
)
def test_process_devices_spread_over_gpus(spec, procs, gpus, expected):
    assert trainer.process_devices(spec, procs, gpus) == expected


def test_auto_is_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert trainer.resolve_device("auto") == torch.device("cpu")


def test_auto_is_cuda_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert trainer.resolve_device("auto") == torch.device("cuda")


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="asks for CUDA"):
        trainer.resolve_device("cuda:0")


def test_a_gpu_index_that_does_not_exist_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="has 2 GPU"):
        trainer.resolve_device("cuda:2")
    assert trainer.resolve_device("cuda:1") == torch.device("cuda:1")


def test_copies_are_synchronised_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    replica.sync(torch.device("cpu"))
    assert calls == []
    replica.sync(torch.device("cuda:1"))
    assert calls == [torch.device("cuda:1")]
