"""``paramserver export``: the whole model from a run's server checkpoints, without the
servers, whether one server or several shards wrote them (dense ranges, buffers, every
table's rows, frozen parameters), from the last checkpoints or a consistent cut."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver import models
from paramserver.errors import ConfigError
from paramserver.server.disk import checkpoint
from paramserver.server.disk.export import Final, choose, export
from tests.conftest import paramserver_run

MODEL, SEED, STEPS = "tests.sparse_models:Mixed", 3, 12


def mixed_server(serve, directory, shard: int, shards: int) -> ps.ServerApp:
    """Shard ``shard`` of ``shards`` of a sync run of MODEL (one worker) that checkpoints
    into ``directory``, cutting every 5 rounds."""
    return serve(
        MODEL,
        seed=SEED,
        optimizer="adam",
        lr=0.05,
        policy="sync",
        workers=1,
        shard=shard,
        shards=shards,
        checkpoint_dir=str(directory),
        checkpoint_every="5",
    )


def _train(serve, directory, shards: int) -> dict[str, torch.Tensor] | None:
    """A sync run of STEPS batches over ``shards`` servers that cut every 5 rounds; the
    single server's whole model (its ``model_state_dict()``), None for shards."""
    servers = [mixed_server(serve, directory, i, shards) for i in range(shards)]
    model = models.build(MODEL, seed=SEED)
    g = torch.Generator().manual_seed(0)
    with ps.Worker([s.address for s in servers], model) as worker:
        for _ in range(STEPS):
            x = torch.randint(0, 200, (16, 3), generator=g)
            F.cross_entropy(model(x), x[:, 0] % 2).backward()
            worker.step(samples=len(x))
    whole = servers[0].model_state_dict() if shards == 1 else None
    for s in servers:
        s.stop()  # each writes its last checkpoint
    return whole


def test_export_puts_the_shards_back_together_as_the_single_servers_model(serve, tmp_path):
    single = _train(serve, tmp_path / "one", 1)
    assert single is not None
    _train(serve, tmp_path / "two", 2)
    for name in ("one", "two"):
        path, version, which = export(tmp_path / name, MODEL, SEED, tmp_path / f"{name}.pt")
        assert version == STEPS and which.startswith("the shards' last checkpoints")
        saved = torch.load(path, weights_only=True)
        state = saved["model_state_dict"]
        assert state.keys() == single.keys()
        for key, value in single.items():  # sync: the same math, sharded or not
            torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7, msg=key)
        assert state["norm.num_batches_tracked"].dtype == torch.int64
        assert int(state["norm.num_batches_tracked"]) == STEPS
        fresh = models.build(MODEL, seed=0)  # another seed: the export sets every tensor
        fresh.load_state_dict(state, strict=True)
        assert saved["version"] == STEPS and saved["model"] == MODEL


def test_export_falls_back_to_a_consistent_cut_and_names_what_it_lacks(serve, tmp_path):
    _train(serve, tmp_path, 2)
    # cuts every 5 rounds, and one at the run's end (round 12: the last worker left)
    assert set(checkpoint.list_cuts(tmp_path, 0, 2)) >= {10, 12}
    (tmp_path / checkpoint.server_file(1, 2)).unlink()  # shard 1's last checkpoint is lost
    result = paramserver_run(
        "export",
        str(tmp_path),
        "--model",
        MODEL,
        "--seed",
        str(SEED),
        "--out",
        str(tmp_path / "cut.pt"),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"{tmp_path / 'cut.pt'}: version 12, from the cuts of round 12, the newest on every "
        "shard (shard 1 has none)"
    )
    cut = torch.load(tmp_path / "cut.pt", weights_only=True)["model_state_dict"]
    assert int(cut["norm.num_batches_tracked"]) == 12
    path, version, which = export(tmp_path, MODEL, SEED, tmp_path / "ten.pt", round_=10)
    assert version == 10 and which == "the cuts of round 10, as asked"
    with pytest.raises(ConfigError, match="cut at round 7"):
        export(tmp_path, MODEL, SEED, tmp_path / "x.pt", round_=7)
    with pytest.raises(ConfigError, match="values; the model has"):
        export(tmp_path, "tests.sparse_models:Mixed2", SEED, tmp_path / "x.pt")


def test_which_files_are_read():
    a, b = Final(12, {"A": 6, "B": 6}), Final(11, {"A": 6, "B": 5})
    assert choose([a, a], [{5, 10}, {5, 10}], None)[0] is None  # the last checkpoints agree
    assert choose([a, b], [{5, 10}, {5, 10}], None)[0] == 10  # they do not: the newest cut
    assert choose([a, None], [{5, 10}, {10}], None)[0] == 10
    assert choose([a, a], [{5, 10}, {5, 10}], 5)[0] == 5
    with pytest.raises(ConfigError, match="no round has a cut on every shard"):
        choose([a, None], [{5}, {10}], None)
    with pytest.raises(ConfigError, match="cut at round 10"):
        choose([a, a], [{5, 10}, {5}], 10)


def test_equal_versions_holding_different_pushes_are_not_mixed():
    """Async, 2 shards, stopped while worker A's step had reached only shard 0 and B's only
    shard 1: both at version 1, with clocks A 1 B 0 and A 0 B 1. The last checkpoints do not
    make one model: the newest common cut is read, and the reason said."""
    zero, one = Final(1, {"A": 1, "B": 0}), Final(1, {"A": 0, "B": 1})
    chosen, which = choose([zero, one], [{0}, {0}], None)
    assert chosen == 0
    assert which == (
        "the cuts of round 0, the newest on every shard (clocks shard 0 {'A': 1, 'B': 0}, "
        "shard 1 {'A': 0, 'B': 1})"
    )
    with pytest.raises(ConfigError, match="do not hold the same pushes .clocks shard 0"):
        choose([zero, one], [set(), set()], None)


def test_export_of_another_model_says_so_in_one_line(serve, tmp_path):
    _train(serve, tmp_path, 1)
    result = paramserver_run("export", str(tmp_path), "--model", "mlp")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is --model the run's?" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def _files(directory) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*")}


def test_a_server_refuses_the_rows_of_another_table_layout_and_writes_nothing(serve, tmp_path):
    """The same dense part, a table of more rows: the server does not start, naming the row
    folder, and the checkpoint folder is left as it was."""
    _train(serve, tmp_path, 1)
    before = _files(tmp_path)
    with pytest.raises(ConfigError, match="another table layout") as err:
        serve(
            "tests.sparse_models:MixedMoreRows",
            seed=SEED,
            optimizer="adam",
            lr=0.05,
            workers=1,
            checkpoint_dir=str(tmp_path),
        )
    assert "rows-shard0of1-" in str(err.value)
    assert _files(tmp_path) == before


@pytest.mark.parametrize("shards", [1, 2])
def test_a_torn_row_file_is_refused_by_name_by_export_and_by_the_server(serve, tmp_path, shards):
    """A row file cut short (a disk that lost its tail): export and a restarted server both
    refuse it, naming the file; export writes nothing."""
    _train(serve, tmp_path, shards)
    shard = shards - 1
    last = checkpoint.load(tmp_path / checkpoint.server_file(shard, shards))
    # the oldest folder that holds rows: the newest cut's chain, which a shard resumes from,
    # has it too (a shard's base, written as it starts, holds none)
    files = [tmp_path / name / "emb.values.bin" for name in last["row_chain"]]
    torn = next(f for f in files if f.stat().st_size)
    os.truncate(torn, torn.stat().st_size // 2)
    with pytest.raises(ConfigError, match="torn or truncated") as err:
        export(tmp_path, MODEL, SEED, tmp_path / "x.pt")
    assert str(torn) in str(err.value) and not (tmp_path / "x.pt").exists()
    with pytest.raises(ConfigError, match="torn or truncated") as err:
        mixed_server(serve, tmp_path, shard, shards)
    assert str(torn) in str(err.value)
