"""The tables' row files (``server/disk/row_format.py``, ``server/disk/row_writer.py``): each checkpoint
writes the rows changed since the previous one, the chain is merged on disk now and then,
and a restore gives back every table row for row (values, optimizer state, counters,
lifecycle), reading a bounded chunk at a time. A torn, damaged, replaced or foreign file
is refused with its name, and nothing is restored from it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from paramserver.errors import ConfigError
from paramserver.server.disk import row_format
from paramserver.server.disk.row_reader import Folder, RowChain
from paramserver.server.disk.row_writer import RowLog
from paramserver.sparse import tablestate
from paramserver.sparse.lifecycle import Lifecycle
from paramserver.sparse.table import TableSpec
from paramserver.sparse.tableset import RowGradients, TableSet, row_optimizer

ROWS, DIM = 5000, 8
LIFE = Lifecycle(admit_after=2, capacity=600, ttl=25, sketch=4096)


def _tables(dim: int = DIM, names: tuple[str, str] = ("t", "u"), life=LIFE) -> TableSet:
    specs = [TableSpec(names[0], ROWS, dim), TableSpec(names[1], 0, 4)]  # u: unbounded
    return TableSet(specs, row_optimizer("adam", 0.05), seed=1, lifecycles={names[0]: life})


def _step(ts: TableSet, step: int, rng: np.random.Generator) -> None:
    t_ids = np.unique((rng.zipf(1.3, 120) - 1) % ROWS)
    u_ids = np.unique(rng.integers(-(2**62), 2**62, 30))
    pushes = [
        RowGradients("t", t_ids, torch.from_numpy(rng.standard_normal((len(t_ids), DIM), "f4"))),
        RowGradients("u", u_ids, torch.from_numpy(rng.standard_normal((len(u_ids), 4), "f4"))),
    ]
    ts.apply(ts.check(pushes), step=step)


def _same(a: TableSet, b: TableSet) -> None:
    for name in a.tables:
        x, y = tablestate.state_dict(a.table(name)), tablestate.state_dict(b.table(name))
        ox, oy = np.argsort(x["ids"].numpy()), np.argsort(y["ids"].numpy())
        assert torch.equal(x["ids"][ox], y["ids"][oy]), name
        assert torch.equal(x["values"][ox], y["values"][oy]), name
        for sx, sy in zip(x["state"], y["state"], strict=True):
            assert torch.equal(sx[ox], sy[oy]), name
        for key in ("hits", "last"):
            assert torch.equal(x[key][ox], y[key][oy]), (name, key)
        assert x["steps"] == y["steps"] and x["swept"] == y["swept"], name
        for key, value in x["tally"].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(y["tally"][key])), key
        if x["sketch"] is not None:
            assert torch.equal(x["sketch"], y["sketch"]), name


def _run(tmp_path: Path, steps: int, every: int, full_every: int, seed: int = 0):
    live, rng = _tables(), np.random.default_rng(seed)
    log = RowLog(tmp_path, 0, 1, None, full_every)
    chain: tuple[list[str], dict[str, str]] = ([], {})
    for step in range(1, steps + 1):
        _step(live, step, rng)
        if step % every == 0:
            chain = log.write(live.take_changes(), live.layouts())
    return live, log, chain, rng


def test_a_restore_from_a_base_and_its_deltas_equals_the_live_tables_and_goes_on_as_they_do(
    tmp_path,
):
    live, rng = _tables(), np.random.default_rng(0)
    log = RowLog(tmp_path, 0, 1, None, full_every=3)
    deltas = []
    for step in range(1, 61):
        _step(live, step, rng)
        if step % 4 == 0:
            names, sums = log.write(live.take_changes(), live.layouts())
            deltas.append(len(names) - 1)
            back = _tables()
            RowChain(tmp_path, names, sums).restore(back)
            _same(live, back)
            log.collect()
    assert live.table("t").tally.evicted > 0 and live.table("t").tally.dropped > 0
    assert log.merges >= 3 and max(deltas) == 2  # restored from deltas and from merged bases
    for step in range(61, 81):  # the restored tables go on exactly as the live ones
        state = rng.bit_generator.state
        _step(live, step, rng)
        rng.bit_generator.state = state
        _step(back, step, rng)
    _same(live, back)
    # folders no chain names were removed: this chain and the one before the last write
    log.collect()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) | set(log._before))
    assert len(list(tmp_path.iterdir())) <= 2 * 3


def test_a_take_copies_only_the_rows_changed_since_the_last_one():
    ts, rng = _tables(life=Lifecycle()), np.random.default_rng(1)
    for step in range(1, 31):
        _step(ts, step, rng)
    first = ts.take_changes()
    assert len(first["t"].rows) == ts.table("t").held
    ids = np.array([3, 7, 11])
    ts.apply(ts.check([RowGradients("t", ids, torch.ones(3, DIM))]), step=31)
    second = ts.take_changes()
    assert second["t"].rows.ids.tolist() == [3, 7, 11] and len(second["u"].rows) == 0
    assert len(ts.take_changes()["t"].rows) == 0


def test_merging_and_restoring_read_a_bounded_chunk_of_each_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(row_format, "CHUNK", 64)
    read = []
    block = Folder.block

    def spy(self, table, lo, hi):
        out = block(self, table, lo, hi)
        read.append(len(out))
        return out

    monkeypatch.setattr(Folder, "block", spy)
    live, log, (names, sums), _ = _run(tmp_path, 40, 5, full_every=100)
    chain = RowChain(tmp_path, names, sums)
    merged = list(chain.merged("t"))
    assert max(read) <= 64 and len(merged) > 1
    ids = np.concatenate([b.ids for b in merged])
    assert np.array_equal(ids, np.sort(tablestate.state_dict(live.table("t"))["ids"].numpy()))
    read.clear()
    back = _tables()
    chain.restore(back)
    assert max(read) <= 64
    _same(live, back)


def _chain(tmp_path: Path, seed: int = 0) -> RowChain:
    _, _, (names, sums), _ = _run(tmp_path, 12, 4, full_every=100, seed=seed)
    return RowChain(tmp_path, names, sums)


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        ("truncate", "torn or truncated"),
        ("flip", "does not match its checksum"),
        ("manifest", "missing or was not written whole"),
        ("replaced", "not the one the checkpoint wrote"),
        ("parent", "the row chain is broken"),
    ],
)
def test_a_torn_damaged_or_replaced_row_folder_is_refused_by_name(tmp_path, damage, says):
    chain = _chain(tmp_path / "a")
    last = chain.directory / chain.names[-1]
    values = last / "t.values.bin"
    if damage == "truncate":
        os.truncate(values, values.stat().st_size - 4)
    elif damage == "flip":
        data = bytearray(values.read_bytes())
        data[len(data) // 2] ^= 0xFF
        values.write_bytes(bytes(data))
    elif damage == "manifest":
        (last / "manifest.json").unlink()
    elif damage == "replaced":  # another run's folder of the same name
        other = _chain(tmp_path / "b", seed=1)
        shutil.rmtree(last)
        shutil.copytree(other.directory / other.names[-1], last)
    else:  # a chain that skips a delta
        chain = RowChain(chain.directory, [chain.names[0], chain.names[2]], chain.sums)
    target = _tables()
    with pytest.raises(ConfigError, match=says) as err:
        chain.restore(target)
    assert str(chain.directory) in str(err.value)
    assert target.held == 0  # nothing was restored


@pytest.mark.parametrize(
    ("made", "says"),
    [
        (lambda: _tables(dim=16), "another table layout"),
        (lambda: _tables(names=("t", "w")), "checkpoint of another model"),
    ],
)
def test_rows_of_another_model_or_table_layout_are_refused(tmp_path, made, says):
    chain = _chain(tmp_path)
    target = made()
    with pytest.raises(ConfigError, match=says) as err:
        chain.restore(target)
    assert chain.names[-1] in str(err.value) and target.held == 0


def test_a_folder_left_half_written_by_a_killed_writer_is_ignored_and_removed(tmp_path):
    chain = _chain(tmp_path)
    torn = tmp_path / f".{row_format.folder_name(0, 1, 99)}.tmp-{2**22 + 7}"  # no such process
    torn.mkdir()
    (torn / "t.values.bin").write_bytes(b"\0" * 100)
    assert 99 not in row_format.existing(tmp_path, 0, 1)
    row_format.collect(tmp_path, 0, 1, set(chain.names))
    assert not torn.exists()
    assert sorted(row_format.existing(tmp_path, 0, 1).values()) == chain.names


def test_a_merge_that_fails_leaves_the_deltas_named_and_is_tried_again(tmp_path, monkeypatch):
    live, rng = _tables(), np.random.default_rng(2)
    log = RowLog(tmp_path, 0, 1, None, full_every=2)
    compact = row_format.compact
    calls = []

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return compact(*args, **kwargs)

    monkeypatch.setattr(row_format, "compact", full_disk)
    lengths = []
    for step in range(1, 5):
        _step(live, step, rng)
        names, sums = log.write(live.take_changes(), live.layouts())
        lengths.append(len(names))
        back = _tables()
        RowChain(tmp_path, names, sums).restore(back)
        _same(live, back)
    assert log.merge_failures == 1 and log.merges == 1
    assert lengths == [1, 2, 3, 1]  # the failed merge's chain goes on, the next one merges
