"""``--server-device`` on a CPU host: the option's checks (a GPU torch does not see is one
sentence before anything starts), launch spreading shards over the GPUs (a fake CUDA), and
the store's GPU bookkeeping run on the CPU (``mirrored``: a master apart from the host copy
that pulls and checkpoints read), equal to the plain store step for step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paramserver.cluster import commands
from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.config.devices import check_server_device, shard_device
from paramserver.errors import ConfigError
from paramserver.server.bookkeeping.store import ParameterStore
from tests.conftest import cli

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")


class FakeCuda:
    def __init__(self, count: int):
        self.count = count

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count


@pytest.mark.parametrize(
    "spec,gpus,error",
    [
        ("cpu", 0, None),
        ("cuda", 1, None),
        ("cuda:1", 2, None),
        ("gpu", 2, "--server-device must be cpu, cuda or cuda:I; got 'gpu'."),
        ("cuda:", 2, "--server-device must be cpu, cuda or cuda:I; got 'cuda:'."),
        ("cuda", 0, "--server-device cuda asks for a GPU, but this torch build sees none"),
        ("cuda:2", 2, "--server-device cuda:2: this host has 2 GPUs (cuda:0 to cuda:1)."),
    ],
)
def test_the_server_device_is_checked(spec, gpus, error):
    if error is None:
        check_server_device(spec, FakeCuda(gpus))
        return
    with pytest.raises(ConfigError) as exc:
        check_server_device(spec, FakeCuda(gpus))
    assert error in str(exc.value)


def test_launch_spreads_its_shards_over_the_gpus(monkeypatch):
    fake = FakeCuda(3)
    assert [shard_device("cuda", i, fake) for i in range(4)] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:0",
    ]
    assert shard_device("cuda:1", 2, fake) == "cuda:1"
    assert shard_device("cpu", 2, fake) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", fake.is_available)
    monkeypatch.setattr(torch.cuda, "device_count", fake.device_count)
    cfg = ServerConfig(server_device="cuda", threads=1)
    shard = commands.shard_config(cfg, 1, 2, "127.0.0.1")
    assert (shard.server_device, shard.shard, shard.shards) == ("cuda:1", 1, 2)
    args = commands.server_args(shard)
    assert args[args.index("--server-device") + 1] == "cuda:1"


@NO_GPU
def test_a_gpu_server_on_a_cpu_only_torch_is_refused_before_it_starts(tmp_path):
    with pytest.raises(ConfigError, match="sees none"):
        ServerConfig(server_device="cuda")
    out = cli("server", "--port", "0", "--server-device", "cuda")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--server-device cuda asks for a GPU" in out.stderr
    runs = tmp_path / "runs"
    out = cli("launch", "--server-device", "cuda", "--runs-dir", str(runs), "--workers", "1")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--server-device cuda asks for a GPU" in out.stderr
    assert not runs.exists() or not any(runs.iterdir())  # nothing started, no run folder


def _stores(optimizer: str) -> tuple[ParameterStore, ParameterStore, Manifest]:
    params, buffer = torch.randn(1000), torch.randn(24)
    manifest = Manifest.from_tensors([("w", params), ("b", buffer)], ["param", "buffer"])
    initial = torch.cat([params, buffer]).numpy()
    cfg = OptimizerConfig(optimizer, lr=0.01)
    plain = ParameterStore(manifest, initial, cfg)
    mirrored = ParameterStore(manifest, initial, cfg, mirrored=True)
    return plain, mirrored, manifest


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_a_mirrored_store_steps_exactly_as_the_plain_one(optimizer):
    plain, mirrored, manifest = _stores(optimizer)
    assert mirrored.flat.data_ptr() != mirrored.host.data_ptr()  # a master apart
    g = np.random.default_rng(0)
    for _ in range(5):
        grad = g.standard_normal(1000).astype(np.float32)
        plain.apply(grad)
        mirrored.apply(grad)
        assert np.array_equal(mirrored.weights, plain.weights)  # the host copy is current
    values = g.standard_normal(24).astype(np.float32)
    plain.set_buffers(values)
    mirrored.set_buffers(values)
    assert np.array_equal(mirrored.weights, plain.weights)
    assert np.array_equal(mirrored.flat.numpy(), plain.weights)


def test_the_optimizer_state_a_checkpoint_holds_is_a_host_copy_that_resumes_anywhere():
    plain, mirrored, _ = _stores("adam")
    g = np.random.default_rng(1)
    grads = [g.standard_normal(1000).astype(np.float32) for _ in range(6)]
    for grad in grads[:3]:
        mirrored.apply(grad)
        plain.apply(grad)
    saved = mirrored.optimizer_state()
    moment = saved["state"][0]["exp_avg"]
    assert moment.device.type == "cpu"
    mirrored.apply(grads[3])  # the copy does not move with the store
    assert not torch.equal(moment, mirrored.optimizer.state[mirrored.param]["exp_avg"])
    # a GPU shard's checkpoint resumes on a CPU shard (and the other way round)
    resumed, _, _ = _stores("adam")
    resumed.restore(plain.weights.copy(), saved, 3)
    again = ParameterStore(resumed.manifest, resumed.weights.copy(), resumed.config, mirrored=True)
    again.restore(resumed.weights.copy(), resumed.optimizer_state(), 3)
    for grad in grads[3:]:
        plain.apply(grad)
        again.apply(grad)
    assert np.array_equal(again.weights, plain.weights)
    assert again.version == plain.version == 6
