"""``paramserver bench step`` and ``bench scaling`` with ``--device cuda`` on a real GPU
(issue 42): each CUDA case's ratio comes out, positive and finite, and the line names the
GPU and torch. Skipped where no GPU exists (tests/unit/test_bench_device.py runs the same
code on the CPU). On a GPU host: ``python -m pytest tests/gpu/test_bench_gpu.py -q``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: tests/gpu runs on a GPU host"
)

CASES = ("cuda_mlp_64", "cuda_mlp_256", "cuda_resnet_256", "cuda_mlp_20m_1024")


def _bench(name: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "paramserver", "bench", name, "--device", "cuda", "--quick"]
        + ["--json"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["bench"] == name and figures["quick"] is True
    assert figures["device"] == "cuda"
    assert figures["gpu"] == torch.cuda.get_device_name() and figures["gpu"] != "none"
    assert figures["torch"] == torch.__version__
    assert figures["machine"]["gpu"] == figures["gpu"]
    return figures


def _fine(value: float) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_bench_step_on_cuda() -> None:
    figures = _bench("step")
    for case in CASES:
        assert _fine(figures[f"step_vs_local_{case}"]), case
        assert _fine(figures[f"local_ms_{case}"]) and _fine(figures[f"worker_ms_{case}"])
    assert figures["target_step_vs_local_cuda_mlp_20m_1024"] == 2.5
    assert figures["target_step_vs_local_cuda_mlp_64"] == 1.5
    assert figures["target_step_vs_local_cuda_resnet_256"] == 1.3
    assert isinstance(figures["target_met_cuda"], bool)
    assert "step_vs_local_64" not in figures  # the CPU run's keys are the CPU run's


def test_bench_scaling_on_cuda() -> None:
    figures = _bench("scaling")
    assert figures["workers"] == [1, 2]
    for case in CASES:
        assert _fine(figures[f"local_samples_per_s_{case}"]), case
        ratios = figures[f"async_vs_local_{case}"]
        assert len(ratios) == 2 and all(_fine(r) for r in ratios), (case, ratios)
    assert figures["target_2_workers_vs_local_cuda_mlp_64"] == 0.9
    assert figures["target_2_workers_vs_local_cuda_resnet_256"] == 0.9
    assert figures["target_2_workers_vs_local_cuda_mlp_20m_1024"] == 0.4
    assert "async_vs_local" not in figures
