"""``bench step`` and ``bench scaling`` with ``--device`` (issue 42): the CUDA cases' code
runs here on the CPU, with small stand-ins for their sizes (CI has no GPU;
tests/gpu/test_bench_gpu.py runs the real thing where one is), and ``--device cuda``
without a GPU is one line and exit 2."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch

from paramserver import models
from paramserver.bench.throughput import devices, scaling, step
from paramserver.errors import ConfigError
from tests.conftest import paramserver_run

CPU = torch.device("cpu")
CUDA_KEYS = ("cuda_mlp_64", "cuda_mlp_256", "cuda_resnet_256", "cuda_mlp_20m_1024")


def stand_ins(found: tuple[devices.Case, ...]) -> tuple[devices.Case, ...]:
    """The CUDA cases at a 32nd of their batch, the 20M-parameter MLP as the MLP: each
    still its own case (its own key), small enough for a CPU test."""
    return tuple(("mlp" if m == devices.BIG else m, b // 32) for m, b in found)


def _positive_finite(value: float) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_the_cuda_cases_and_their_keys() -> None:
    found = devices.cases("cuda")
    assert found == (("mlp", 64), ("mlp", 256), ("resnet", 256), ("mlp-20m", 1024))
    assert tuple(devices.key(torch.device("cuda"), m, b) for m, b in found) == CUDA_KEYS
    assert devices.cases("cpu") == (("mlp", 64), ("mlp", 256))
    # every target is of a case measured
    assert set(devices.STEP_TARGETS) <= set(found)
    assert set(devices.SCALING_TARGETS) == {m for m, _ in found}
    assert len(set(stand_ins(found))) == len(found)


def test_the_20m_mlp_is_in_the_registry() -> None:
    model = models.build("mlp-20m", seed=0)
    count = sum(p.numel() for p in model.parameters())
    assert count == 784 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10  # 20.0M
    assert 4 * count > 80e6  # 80 MB of float32
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_the_cuda_step_runs_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    found = stand_ins(devices.cases("cuda"))
    monkeypatch.setattr(devices, "STEP_TARGETS", {found[0]: 1e6, found[2]: 1e-6})
    rows, figures = step.run_on(CPU, found, reps=3)
    keys = [devices.key(CPU, m, b) for m, b in found]
    assert keys == ["cpu_mlp_2", "cpu_mlp_8", "cpu_resnet_8", "cpu_mlp_32"]
    for k in keys:
        assert _positive_finite(figures[f"step_vs_local_{k}"]), k
        assert _positive_finite(figures[f"local_ms_{k}"]) and _positive_finite(
            figures[f"worker_ms_{k}"]
        )
    assert figures["target_step_vs_local_cpu_mlp_2"] == 1e6
    assert figures["target_step_vs_local_cpu_resnet_8"] == 1e-6
    assert "target_step_vs_local_cpu_mlp_8" not in figures
    assert figures["target_met_cpu"] is False  # the second target cannot be met
    assert figures["device"] == "cpu" and figures["gpu"] == "none"
    assert figures["torch"] == torch.__version__
    verdicts = [value for _, value in rows if "target" in value]
    assert len(verdicts) == 2 and "met" in verdicts[0] and "missed" in verdicts[1]
    assert not any(k.startswith("step_vs_local_") and "cuda" in k for k in figures)


def test_the_cuda_scaling_runs_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "SCALING_TARGETS", {"mlp": 1e-6})
    rows, figures = scaling.run_on(CPU, (("mlp", 16),), (0.2, 0.5), reps=3)
    assert figures["workers"] == [1, 2] and figures["device"] == "cpu"
    assert _positive_finite(figures["local_samples_per_s_cpu_mlp_16"])
    rates, ratios = figures["async_samples_per_s_cpu_mlp_16"], figures["async_vs_local_cpu_mlp_16"]
    assert len(rates) == len(ratios) == 2
    assert all(_positive_finite(r) for r in rates + ratios), (rates, ratios)
    assert figures["target_2_workers_vs_local_cpu_mlp_16"] == 1e-6
    assert figures["target_met_cpu"] is True
    assert any("2 workers >= 1e-06 x: met" in value for _, value in rows), rows


def test_device_resolves_auto_cpu_and_refuses_cuda_without_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve("auto") == CPU and devices.resolve("cpu") == CPU
    with pytest.raises(ConfigError, match="--device cuda asks for CUDA"):
        devices.resolve("cuda")
    with pytest.raises(ConfigError, match="--device must be one of auto, cpu, cuda"):
        devices.resolve("cuda:0")
    # the modules resolve before they measure anything
    with pytest.raises(ConfigError):
        step.run(True, "cuda")
    with pytest.raises(ConfigError):
        scaling.run(True, "cuda")


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return paramserver_run("bench", *args, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: --device cuda runs")
@pytest.mark.parametrize("name", ["step", "scaling"])
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(name: str) -> None:
    out = _bench(name, "--device", "cuda", "--quick", "--json")
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"paramserver: error: --device cuda asks for CUDA, but this torch build sees no GPU "
        f"(torch {torch.__version__}); use --device cpu or auto."
    ]


def test_device_is_for_step_and_scaling_only() -> None:
    out = _bench("transport", "--device", "cpu", "--quick")
    assert out.returncode == 2
    assert out.stderr.strip() == "paramserver: error: --device is for bench step and scaling."
    out = _bench("step", "--device", "gpu")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "'gpu' is not one of 'auto', 'cpu', 'cuda'" in out.stderr


def _machine(gpu: str) -> dict[str, object]:
    return {"cpu": "C", "cores": 16, "memory_gib": 128, "gpu": gpu, "torch": "t", "python": "p"}


def test_readme_shows_gpu_rows_from_gpu_lines_only(tmp_path: Path) -> None:
    from paramserver.bench.report import readme
    from tests.unit.test_readme_figures import _bench, _record

    cpu = {"date": "2026-11-27 05:00 UTC", "machine": _machine("none"), "step_vs_local_64": 1.7}
    cpu["target_step_vs_local_64"] = 1.3
    gpu = {"date": "2026-11-27 06:00 UTC", "machine": _machine("NVIDIA H100"), "device": "cuda"}
    gpu |= {"step_vs_local_cuda_mlp_20m_1024": 2.25, "target_step_vs_local_cuda_mlp_20m_1024": 2.5}
    _bench(tmp_path, "step", cpu)
    plain = readme.block([_record("sync", 0.89)], readme.load_bench(tmp_path))
    assert "on a GPU" not in plain and "_cuda_" not in plain
    # a GPU run after the CPU run: both quoted, each from its own device's lines
    _bench(tmp_path, "step", cpu, dict(cpu, date="2026-11-27 05:04 UTC"), gpu)
    block = readme.block([_record("sync", 0.89)], readme.load_bench(tmp_path))
    cpu_row = next(ln for ln in block.splitlines() if "`step_vs_local_64`" in ln)
    assert "| 1.70 / 1.70 × | 1.3 × |" in cpu_row and "`step.json` lines 1, 2 |" in cpu_row
    gpu_row = next(ln for ln in block.splitlines() if "`step_vs_local_cuda_mlp_20m_1024`" in ln)
    assert "| 2.25 × | 2.5 × | 2026-11-27, machine 1; `step.json` line 3 |" in gpu_row
    assert "- machine 1: C, 16 cores, 128 GiB, GPU NVIDIA H100;" in block  # each named once
    assert "- machine 2: C, 16 cores, 128 GiB, GPU none;" in block
    assert cpu_row.endswith("| 2026-11-27, machine 2; `step.json` lines 1, 2 |")
