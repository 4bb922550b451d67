"""A run checkpointed by 2 shards resumes on 3 and on 1 (servers started with another
--shards re-partition the checkpoints by themselves; ``paramserver checkpoint reshard``
does it offline): dense ranges, the optimizer's state, the buffers, every table's rows with
their optimizer state, and the run's clocks survive, so the resumed run ends with the
weights of the 2-shard run going on. Bad inputs are refused by name, nothing written."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver import models
from paramserver.errors import ConfigError
from paramserver.server.disk import checkpoint
from paramserver.server.disk.reshard import reshard
from tests.conftest import paramserver_run
from tests.integration.test_export import MODEL, SEED, mixed_server

# MODEL: a table, BatchNorm, a frozen parameter
FIRST, THEN = 10, 8  # batches before the checkpoint (a cut: shards resume from cuts), and after


def _servers(serve, directory, shards: int) -> list[ps.ServerApp]:
    return [mixed_server(serve, directory, i, shards) for i in range(shards)]


def _train(servers: list[ps.ServerApp], first: int, steps: int) -> None:
    """Batches ``first`` .. ``first + steps - 1`` (each the same whatever the run)."""
    model = models.build(MODEL, seed=SEED)
    with ps.Worker([s.address for s in servers], model) as worker:
        for i in range(first, first + steps):
            x = torch.randint(0, 200, (16, 3), generator=torch.Generator().manual_seed(i))
            F.cross_entropy(model(x), x[:, 0] % 2).backward()
            worker.step(samples=len(x))


def _after(serve, directory, shards: int) -> dict[str, torch.Tensor]:
    """The whole model after servers of ``shards`` shards resumed from ``directory`` and
    trained on; the servers stopped."""
    servers = _servers(serve, directory, shards)
    assert all(s.status()["version"] == FIRST for s in servers)
    _train(servers, FIRST, THEN)
    state = ps.model_state_dict([s.address for s in servers], MODEL)
    for s in servers:
        s.stop()
    return state


@pytest.fixture
def checkpointed(serve, tmp_path):
    """The folder of a 2-shard run stopped after FIRST batches."""
    folder = tmp_path / "run"
    servers = _servers(serve, folder, 2)
    _train(servers, 0, FIRST)
    for s in servers:
        s.stop()
    return folder


def test_a_two_shard_checkpoint_resumes_on_three_and_on_one_as_the_run_going_on(
    serve, tmp_path, checkpointed
):
    for name in ("two", "three", "one", "offline"):
        shutil.copytree(checkpointed, tmp_path / name)
    want = _after(serve, tmp_path / "two", 2)
    result = paramserver_run(
        "checkpoint",
        "reshard",
        str(tmp_path / "offline"),
        "--model",
        MODEL,
        "--seed",
        str(SEED),
        "--shards",
        "3",
    )
    assert result.returncode == 0, result.stderr
    assert "re-partitioned for 3 shard(s), from the shards' last checkpoints" in result.stdout
    for name, shards in (("three", 3), ("one", 1), ("offline", 3)):
        got = _after(serve, tmp_path / name, shards)
        assert set(got) == set(want)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_bad_inputs_to_a_reshard_are_refused_by_name_and_nothing_is_written(tmp_path, checkpointed):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="1 or more"):
        reshard(checkpointed, MODEL, SEED, 0, out)
    with pytest.raises(ConfigError, match="of 2 shards already"):
        reshard(checkpointed, MODEL, SEED, 2, out)
    with pytest.raises(
        ConfigError,
        match=r"shard0of2\.pt was written by a server of --model tests\.sparse_models:Mixed "
        r"and does not match --model tests\.sparse_models:Mixed2: Parameter",
    ):
        reshard(checkpointed, "tests.sparse_models:Mixed2", SEED, 3, out)  # another model
    with pytest.raises(ConfigError, match="Not every shard has a cut at round 7"):
        reshard(checkpointed, MODEL, SEED, 3, out, round_=7)  # mismatched cuts
    shard1 = checkpointed / checkpoint.server_file(1, 2)
    shard1.write_bytes(shard1.read_bytes()[:1000])  # torn
    with pytest.raises(ConfigError, match=str(shard1)):
        reshard(checkpointed, MODEL, SEED, 3, out)
    assert not out.exists()
