"""--server-threads: its default from the host's usable cores (affinity, cgroup quota) over
the shards on the host, and the work split over that many threads (the finiteness check,
the copies out of shared segments)."""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from paramserver.cluster import commands
from paramserver.config import ServerConfig, cores
from paramserver.errors import ConfigError
from paramserver.server.engine import checks
from paramserver.transport import attachments, pieces, segment_io, shm

MIB = 1 << 20


@pytest.fixture
def threads4():
    pieces.set_threads(4)
    yield
    pieces.set_threads(1)


def test_quota_rounds_up_and_max_or_garbage_sets_no_limit():
    assert cores.quota_cores("200000 100000\n") == 2
    assert cores.quota_cores("150000 100000") == 2
    assert cores.quota_cores("50000 100000") == 1
    for none in ("max 100000", None, "", "x y", "0 100000", "1 2 3"):
        assert cores.quota_cores(none) is None, none


def test_usable_cores_is_the_affinity_capped_by_the_tightest_quota():
    assert cores.usable_cores(16) == (16, "16 CPUs in its affinity")
    assert cores.usable_cores(16, ["max 100000", None]) == (16, "16 CPUs in its affinity")
    n, where = cores.usable_cores(16, ["400000 100000", "250000 100000"])
    assert (n, where) == (3, "the cgroup CPU quota (250000 100000)")
    assert cores.usable_cores(2, ["800000 100000"])[0] == 2  # a quota above the affinity
    assert cores.usable_cores(0)[0] == 1


def test_server_threads_share_the_cores_among_the_shards_on_the_host():
    assert cores.server_threads(None, 1, 16, "x") == (16, "the host's usable cores: x")
    n, where = cores.server_threads(None, 4, 16, "x")
    assert n == 4 and "shared by 4 shards" in where
    assert cores.server_threads(None, 3, 2, "x")[0] == 1  # at least one
    assert cores.server_threads(5, 4, 16, "x") == (5, "--server-threads")


def test_host_cores_reads_the_affinity_and_every_cgroup_quota_above(tmp_path, monkeypatch):
    root = tmp_path / "cgroup"
    (root / "a" / "b").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "a" / "cpu.max").write_text("300000 100000\n")
    (root / "a" / "b" / "cpu.max").write_text("max 100000\n")
    own = tmp_path / "self-cgroup"
    own.write_text("0::/a/b\n")
    monkeypatch.setattr(cores, "CGROUP_ROOT", root)
    monkeypatch.setattr(cores, "SELF_CGROUP", own)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cores.host_cores() == (3, "the cgroup CPU quota (300000 100000)")
    (root / "a" / "cpu.max").write_text("max 100000\n")
    assert cores.host_cores() == (8, "8 CPUs in its affinity")
    monkeypatch.setattr(cores, "SELF_CGROUP", tmp_path / "none")  # no cgroup v2: the root's
    (root / "cpu.max").write_text("100000 100000\n")
    assert cores.host_cores()[0] == 1


def test_the_setting_is_computed_unless_given_and_refuses_below_one(monkeypatch):
    assert ServerConfig().threads is None
    assert ServerConfig(threads=3).threads == 3
    with pytest.raises(ConfigError, match="--server-threads must be at least 1"):
        ServerConfig(threads=0)
    assert "--server-threads" not in commands.server_args(ServerConfig())
    args = commands.server_args(ServerConfig(threads=3))
    assert args[args.index("--server-threads") + 1] == "3"


def test_launch_gives_each_shard_its_share_of_the_cores_unless_told(monkeypatch, tmp_path):
    from paramserver.cluster import launch
    from paramserver.config import LaunchConfig

    monkeypatch.setattr(cores, "host_cores", lambda: (16, "16 CPUs in its affinity"))
    started: list[list[str]] = []

    class Stop(Exception):
        pass

    class FakeChild:
        def __init__(self, name, args, *a, **kw):
            started.append(args)

        def wait_for_line(self, marker, timeout):
            raise Stop

    class Run:
        def file(self, name: str) -> Path:
            return tmp_path / name

    monkeypatch.setattr(launch, "Child", FakeChild)
    for given, want in ((None, "4"), (3, "3")):
        cfg = LaunchConfig(server=ServerConfig(threads=given), servers=4)
        with pytest.raises(Stop):
            launch._Cluster(cfg, Run()).start()  # type: ignore[arg-type]
        args = started.pop()
        assert args[args.index("--server-threads") + 1] == want


def test_the_server_takes_the_hosts_cores_and_says_so(monkeypatch, caplog):
    from paramserver.server import app as app_module

    monkeypatch.setattr(app_module, "host_cores", lambda: (3, "3 CPUs in its affinity"))
    before = torch.get_num_threads()
    cfg = ServerConfig(host="127.0.0.1", port=0, data_port="off", dataset="synthetic")
    try:
        caplog.set_level(logging.INFO, logger=app_module.__name__)
        with app_module.ServerApp(cfg) as app:
            assert (app.threads, torch.get_num_threads(), pieces.threads()) == (3, 3, 3)
        said = [r.getMessage() for r in caplog.records if "server threads" in r.getMessage()]
        assert said == [
            "3 server threads (optimizer, checks, shared-memory copies): the host's usable "
            "cores: 3 CPUs in its affinity; weights and optimizer on cpu"
        ]
        with app_module.ServerApp(dataclasses.replace(cfg, threads=1)) as app:
            assert (app.threads, torch.get_num_threads(), pieces.threads()) == (1, 1, 1)
    finally:
        torch.set_num_threads(before)
        pieces.set_threads(1)


def test_bounds_cover_the_range_once_on_aligned_edges():
    for n in (0, 1, 63, 64, 1000, 64 * 1001, 10 * MIB + 3):
        for parts in (1, 2, 3, 4, 7):
            got = pieces.bounds(n, parts, 64)
            assert got[0][0] == 0 and got[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(got, got[1:], strict=False))
            assert all(lo % 64 == 0 for lo, _ in got)
            assert 1 <= len(got) <= parts
    assert len(pieces.bounds(16 * MIB, 4, 64)) == 4


def test_run_waits_for_every_piece_and_raises_the_first_failure(threads4):
    seen: list[tuple[int, int]] = []
    done = threading.Barrier(4)  # the four pieces run at once, on four threads

    def piece(lo: int, hi: int) -> int:
        done.wait(timeout=30)
        seen.append((lo, hi))
        if lo == 0:
            raise ValueError("first")
        return lo

    with pytest.raises(ValueError, match="first"):
        pieces.run(piece, 4096, 4, 64)
    assert sorted(seen) == pieces.bounds(4096, 4, 64)  # none still running after
    assert pieces.run(lambda lo, hi: lo, 4096, 4, 64) == [0, 1024, 2048, 3072]


def test_work_on_a_pool_thread_is_not_split_again(threads4):
    assert pieces.split(64 * MIB) == 4
    assert pieces.split(8 * MIB) == 2  # at least MIN_PIECE_BYTES a piece
    inner = pieces.run(lambda lo, hi: pieces.split(64 * MIB), 4096, 4, 64)
    assert inner == [4, 1, 1, 1]


def _threads_of(monkeypatch, module, name, together=4):
    """Record the thread each call of ``module.name`` runs on; the first call on each of
    ``together`` threads waits for the others' (so they must run at once: a pool thread
    that finished its piece cannot take another's)."""
    seen: set[str] = set()
    meet = threading.Barrier(together)
    real = getattr(module, name)

    def spy(*a, **kw):
        me = threading.current_thread().name
        if me not in seen and len(seen) < together:
            seen.add(me)
            meet.wait(timeout=10)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, spy)
    return seen


def test_the_check_of_a_large_gradient_runs_on_the_servers_threads(threads4, monkeypatch):
    values = np.ones(16 * MIB // 4, np.float32)
    seen = _threads_of(monkeypatch, checks, "_finite")
    assert checks.all_finite(values)
    assert len(seen) == 4
    for at in (0, values.size // 4 - 1, values.size // 2 + 5, values.size - 1):
        for bad in (np.nan, np.inf):
            values[at] = bad
            assert not checks.all_finite(values), (at, bad)
            values[at] = 1.0
    monkeypatch.undo()
    seen = _threads_of(monkeypatch, checks, "_finite", together=1)
    assert checks.all_finite(np.ones(1024, np.float32)) and len(seen) == 1  # small: one


def test_a_sealed_copy_is_split_and_each_thread_scans_its_own_copy(threads4, tmp_path):
    n = 16 * MIB
    data = np.random.default_rng(0).integers(0, 255, n + 4096, dtype=np.uint8)
    mapping = mmap.mmap(-1, n + 4096)
    mapping[:] = data.tobytes()
    out = np.empty(n, np.uint8)
    scanned: list[tuple[int, int, str]] = []
    base = out.ctypes.data
    meet = threading.Barrier(4)  # the four threads' first pieces are scanned at once

    def scan(piece: np.ndarray) -> None:
        at = piece.ctypes.data - base
        assert at >= 0 and at + piece.nbytes <= n  # the copy, never the mapping
        assert np.array_equal(piece, data[4096 + at : 4096 + at + piece.nbytes])  # copied first
        me = threading.current_thread().name
        if me not in {name for *_, name in scanned}:
            meet.wait(timeout=10)
        scanned.append((at, at + piece.nbytes, me))

    segment_io.copy_split(out.data.cast("B"), mapping, 4096, scan)
    mapping.close()
    assert np.array_equal(out, data[4096:])
    spans = sorted((lo, hi) for lo, hi, _ in scanned)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # each byte once
    assert len({name for *_, name in scanned}) == 4


def test_a_named_read_is_split_and_counts_up_to_a_short_piece(threads4, tmp_path, monkeypatch):
    n = 16 * MIB
    data = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
    path = Path(tmp_path / "segment")
    path.write_bytes(b"\0" * 64 + data.tobytes())
    seen = _threads_of(monkeypatch, segment_io, "read_at")
    fd = os.open(path, os.O_RDONLY)
    try:
        out = np.zeros(n, np.uint8)
        assert segment_io.read_split(fd, out.data.cast("B"), 64) == n
        assert np.array_equal(out, data) and len(seen) == 4
        os.truncate(path, 64 + n // 2 + 100)  # cut short inside the third piece
        assert segment_io.read_split(fd, np.zeros(n, np.uint8).data.cast("B"), 64) == n // 2 + 100
    finally:
        os.close(fd)


def _pieces_on(monkeypatch, together=4):
    """The threads the pieces of each ``pieces.run`` run on; the first piece on each of
    ``together`` threads waits for the others' (so they must run at once)."""
    seen: set[str] = set()
    meet = threading.Barrier(together)
    real = pieces.run

    def spy(fn, n, parts, align):
        def piece(lo, hi):
            me = threading.current_thread().name
            if me not in seen and len(seen) < together:
                seen.add(me)
                meet.wait(timeout=10)
            return fn(lo, hi)

        return real(piece, n, parts, align)

    monkeypatch.setattr(pieces, "run", spy)
    return seen


def test_a_large_copy_is_split_over_the_servers_threads(threads4, monkeypatch):
    src = np.random.default_rng(2).standard_normal(16 * MIB // 4).astype(np.float32)
    dst = np.zeros_like(src)
    seen = _pieces_on(monkeypatch)
    pieces.copy(dst, src)
    assert np.array_equal(dst, src) and len(seen) == 4
    as_bytes = np.zeros(src.nbytes, np.uint8)  # any dtypes of one size in bytes
    pieces.copy(as_bytes, src)
    assert np.array_equal(as_bytes.view(np.float32), src)
    with pytest.raises(ValueError, match="one size"):
        pieces.copy(dst[:-1], src)
    with pytest.raises(ValueError, match="contiguous"):
        pieces.copy(dst[::2], src[: src.size // 2])


def test_a_servers_snapshot_and_a_sealed_pull_are_copied_on_its_threads(threads4, monkeypatch):
    """The two copies of 'async' pulls (the version an apply replaces, kept for the pulls
    meanwhile, and the weights written into a worker's segment) run on the server's
    threads: each was one thread's 14 ms for a 20M-parameter model on a GPU host."""
    from paramserver.server.build import build_coordinator

    store = build_coordinator(ServerConfig(model="mlp-20m")).store
    seen = _pieces_on(monkeypatch)
    snap = store.snapshot()
    assert np.array_equal(snap, store.weights) and len(seen) == 4
    if not shm.sealing_available():
        pytest.skip("no memfd seals here: a pull's weights are written with pwrite")
    n = 16 * MIB
    seg = shm.Segment(n, 2, sealed=True)
    att = attachments.Attachments(n)
    try:
        assert att.attach("w", seg.name, seg.nonce, 2)
        monkeypatch.undo()
        seen = _pieces_on(monkeypatch)
        weights = np.arange(n // 4, dtype=np.float32)
        att.put_weights("w", weights)
        assert np.array_equal(seg.weights, weights) and len(seen) == 4
    finally:
        att.close()
        seg.close()
