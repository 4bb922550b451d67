"""A serving snapshot (``paramserver export --snapshot``, ``paramserver.serving.load``): a
run's model from its servers' checkpoints, served with no server running, equal to the
exported model; a snapshot whose files do not match its manifest is refused naming the
file, and nothing is served."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver import models
from paramserver.errors import ConfigError
from paramserver.server.disk.export import export
from paramserver.serving import snapshot
from paramserver.serving.served import ServedTable
from paramserver.sparse.rows import shard_of
from tests.conftest import paramserver_run
from tests.integration.test_export import MODEL, SEED, _train


def test_a_snapshot_serves_the_exported_model_with_no_server(serve, tmp_path):
    _train(serve, tmp_path / "run", 2)
    root, version, which = snapshot.write(tmp_path / "run", MODEL, SEED, tmp_path / "snap")
    assert version == 12 and which.startswith("the shards' last checkpoints")
    path, _, _ = export(tmp_path / "run", MODEL, SEED, tmp_path / "model.pt")
    reference = models.build(MODEL, seed=0)
    reference.load_state_dict(torch.load(path, weights_only=True)["model_state_dict"])
    reference.eval()
    served = ps.serving.load(root)
    assert any(isinstance(m, ServedTable) for m in served.modules())
    x = torch.randint(0, 200, (64, 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(served(x), reference(x))


def test_a_snapshot_of_an_unbounded_table_answers_rows_and_initial_values(serve, tmp_path):
    factory = "tests.sparse_models:Unbounded"
    servers = [
        serve(
            factory,
            optimizer="sgd",
            lr=0.1,
            policy="sync",
            workers=1,
            shard=i,
            shards=2,
            checkpoint_dir=str(tmp_path / "run"),
            checkpoint_every="5",
        )
        for i in range(2)
    ]
    model = models.build(factory)
    ids = torch.tensor([[-(2**62), 7], [2**61, -1]])
    with ps.Worker([s.address for s in servers], model) as worker:
        for _ in range(3):
            F.cross_entropy(model(ids), torch.tensor([0, 1])).backward()
            worker.step(samples=2)
    flat = ids.flatten().numpy()
    owner = [s.coordinator.tables.table("users") for s in servers]
    expected = torch.stack(
        [owner[int(shard_of(np.array([i]), 2)[0])].read(np.array([i]))[0] for i in flat]
    )
    for s in servers:
        s.stop()
    root, _, _ = snapshot.write(tmp_path / "run", factory, 0, tmp_path / "snap")
    served = ps.serving.load(root)
    users = served.users
    torch.testing.assert_close(users.read(flat), expected)
    unseen = np.array([123456789], np.int64)  # never pushed: its initial value, as a server
    holder = owner[int(shard_of(unseen, 2)[0])]
    torch.testing.assert_close(users.read(unseen), holder.read(unseen))


def test_a_snapshot_whose_files_do_not_match_is_refused_naming_the_file(serve, tmp_path):
    _train(serve, tmp_path / "run", 2)
    root, _, _ = snapshot.write(tmp_path / "run", MODEL, SEED, tmp_path / "snap")
    values = sorted(root.glob("tables/*/*.values.npy"))[0]
    data = values.read_bytes()
    values.write_bytes(data[:-4])  # truncated
    with pytest.raises(ConfigError, match=f"{values.name}.*not the"):
        ps.serving.load(root)
    values.write_bytes(data[:-4] + bytes(4))  # the same size, other bytes
    with pytest.raises(ConfigError, match=f"{values.name} does not match"):
        ps.serving.load(root)
    values.unlink()
    with pytest.raises(ConfigError, match=f"{values.name} is missing"):
        ps.serving.load(root)
    with pytest.raises(ConfigError, match="not a snapshot's manifest"):
        ps.serving.load(tmp_path / "run")
    with pytest.raises(ConfigError, match="not an empty folder"):
        snapshot.write(tmp_path / "run", MODEL, SEED, root)
    with pytest.raises(ConfigError, match="values; the model has|do not load into"):
        snapshot.write(tmp_path / "run", "tests.sparse_models:Mixed2", SEED, tmp_path / "other")
    assert not (tmp_path / "other").exists()  # nothing written


def test_export_writes_a_snapshot_from_the_command_line(serve, tmp_path):
    _train(serve, tmp_path / "run", 1)
    out = paramserver_run(
        "export",
        str(tmp_path / "run"),
        "--model",
        MODEL,
        "--seed",
        str(SEED),
        "--snapshot",
        str(tmp_path / "snap"),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(f"{tmp_path / 'snap'}: a snapshot, version 12, from")
    assert (tmp_path / "snap" / "manifest.json").is_file()


def test_deltas_apply_in_order_and_a_gap_or_a_foreign_base_is_refused(serve, tmp_path):
    """A full snapshot of round 10's cuts, a delta of round 12's (the cut the run's end
    makes), a delta of the last checkpoints (the same state: no row): served together they
    equal a full snapshot of the last checkpoints; the deltas hold only the rows that
    changed."""
    _train(serve, tmp_path / "run", 2)
    run = tmp_path / "run"
    full, _, _ = snapshot.write(run, MODEL, SEED, tmp_path / "full", round_=10)
    one, _, _ = snapshot.write(run, MODEL, SEED, tmp_path / "d12", round_=12, bases=[full])
    two, version, _ = snapshot.write(run, MODEL, SEED, tmp_path / "end", bases=[full, one])
    last, _, _ = snapshot.write(run, MODEL, SEED, tmp_path / "last")
    assert version == 12
    chained, whole = ps.serving.load(full, [one, two]), ps.serving.load(last)
    x = torch.randint(0, 200, (64, 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(chained(x), whole(x))
    for name, module in whole.named_modules():
        if isinstance(module, ServedTable):
            ids = np.arange(200, dtype=np.int64)
            torch.testing.assert_close(chained.get_submodule(name).read(ids), module.read(ids))
    rows = lambda root: sum(  # noqa: E731 - a one-line count
        s["rows"]
        for t in json.loads((root / "manifest.json").read_text())["tables"].values()
        for s in t["shards"]
    )
    assert 0 < rows(one) < rows(last) and rows(two) == 0  # only the rows changed since
    with pytest.raises(ConfigError, match="a gap, or a foreign base"):
        ps.serving.load(full, [two])
    with pytest.raises(ConfigError, match="a gap, or a foreign base"):
        ps.serving.load(full, [one, one])
    with pytest.raises(ConfigError, match="a chain starts with a full snapshot"):
        ps.serving.load(one)
    with pytest.raises(ConfigError, match="is a full snapshot, not a delta"):
        ps.serving.load(full, [last])


def test_a_newer_layer_s_eviction_hides_an_older_layer_s_row():
    from paramserver.serving.layers import Layer, ShardRows

    base = Layer(np.array([1, 2, 3]), np.ones((3, 2), np.float32), np.empty(0, np.int64))
    delta = Layer(np.array([3, 9]), np.full((2, 2), 5.0, np.float32), np.array([2]))
    rows = ShardRows([base, delta], 2, "float32")
    values, found = rows.resolve(np.array([1, 2, 3, 9, 4]))
    assert found.tolist() == [True, False, True, True, False]
    assert values[:, 0].tolist() == [1.0, 0.0, 5.0, 5.0, 0.0]
    assert rows.held().tolist() == [1, 3, 9]


def test_a_refused_or_failed_snapshot_writes_nothing_and_the_retry_succeeds(
    serve, tmp_path, monkeypatch
):
    """A base of another model is refused before a file is written (it left ``dense.pt``,
    and the retry with the right base was refused: "not an empty folder"); a write that
    fails on the way (a full disk) leaves nothing either."""
    _train(serve, tmp_path / "run", 2)
    run, out = tmp_path / "run", tmp_path / "delta"
    full, _, _ = snapshot.write(run, MODEL, SEED, tmp_path / "full", round_=10)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for f in full.iterdir():
        (foreign / f.name).symlink_to(f)
    manifest = json.loads((full / "manifest.json").read_text())
    (foreign / "manifest.json").unlink()
    (foreign / "manifest.json").write_text(json.dumps({**manifest, "model": "mlp"}))
    with pytest.raises(ConfigError, match="is a snapshot of 'mlp'"):
        snapshot.write(run, MODEL, SEED, out, bases=[foreign])
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["run", "full", "foreign"]
    )

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(snapshot, "_write_rows", full_disk)
        with pytest.raises(OSError, match="No space left"):
            snapshot.write(run, MODEL, SEED, out, bases=[full])
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["run", "full", "foreign"]
    )
    out.mkdir()  # an empty folder (a mount point, say) is written in place, emptied on failure
    with monkeypatch.context() as m:
        m.setattr(snapshot, "_write_rows", full_disk)
        with pytest.raises(OSError, match="No space left"):
            snapshot.write(run, MODEL, SEED, out, bases=[full])
    assert out.is_dir() and not any(out.iterdir())
    root, version, _ = snapshot.write(run, MODEL, SEED, out, bases=[full])
    assert root == out and version == 12 and (out / "manifest.json").is_file()
