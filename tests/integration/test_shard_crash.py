"""A sharded run survives kill -9 of a shard as one model: the restarted shard resumes from
its newest consistent cut, the other shard rewinds to the same cut, every batch after the
cut is computed again, once. Under sync the run ends with the weights of an uninterrupted
run, sparse tables included; under async (whose order of updates differs from run to run)
both shards end holding exactly one update per batch."""

from __future__ import annotations

import os
import re
import resource
import signal
import time

import grpc
import numpy as np
import pytest

from paramserver import models
from paramserver._proto import paramserver_pb2 as pb
from paramserver.cluster.procs import READY_MARKER, Child, stop_all
from paramserver.codec import layout
from paramserver.server.disk import checkpoint
from paramserver.sparse.remote import Observer, RemoteTables
from paramserver.training import data
from paramserver.transport.channels import observe
from paramserver.transport.stub import Stub, connect
from tests.conftest import DEADLINE

EPOCHS, BATCH, WORKERS, SHARDS, CUT_EVERY = 3, 64, 2, 2, 5
ROUNDS = EPOCHS * data.batches_per_epoch(data.SYNTHETIC_TRAIN, BATCH) // WORKERS


MLP = ("mlp", "synthetic")
TABLES = ("tests.sparse_models:dlrm_sparse", "tests.sparse_models:small_clicks")


def _shard(tmp_path, tag: str, i: int, port: int, n: int, policy: str, what=MLP) -> Child:
    return Child(
        f"{tag}-shard{i}-{n}",
        [
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--shard",
            f"{i}/{SHARDS}",
            "--policy",
            policy,
            "--workers",
            str(WORKERS),
            "--dataset",
            what[1],
            "--batch-size",
            str(BATCH),
            "--epochs",
            str(EPOCHS),
            "--optimizer",
            "sgd",
            "--lr",
            "0.05",
            "--model",
            what[0],
            "--seed",
            "3",
            "--lease-timeout",
            "5",
            "--checkpoint-dir",
            str(tmp_path / tag),
            "--checkpoint-every",
            str(CUT_EVERY),
        ],
        tmp_path / f"{tag}-shard{i}-{n}.log",
        capture_stdout=True,
    )


def _status(address: str) -> pb.StatusResponse | None:
    try:
        channel = connect(address, 5)
    except Exception:  # noqa: BLE001 - not up (yet)
        return None
    try:
        return Stub(channel).Status(pb.StatusRequest(), timeout=10)
    except grpc.RpcError:
        return None
    finally:
        channel.close()


def _run(
    tmp_path,
    tag: str,
    crash: bool,
    policy: str = "sync",
    what=MLP,
    kill=None,
    every=False,
    at_end=False,
) -> tuple[np.ndarray, list[pb.StatusResponse]]:
    """The run's flat weights (and its tables' rows after them), and each shard's status.
    ``crash``: kill -9 shard 1 mid-run (``kill(shard, its folder, the addresses)``,
    which returns shard 1's newest cut on disk) and start it again; ``every``: kill -9
    every shard at once past round 13, and start them all again; ``at_end``: kill -9
    shard 1 once the workers have left, and start it again."""
    procs: list[Child] = []
    try:
        shards = [_shard(tmp_path, tag, i, 0, 1, policy, what) for i in range(SHARDS)]
        procs += shards
        addresses = [s.wait_for_line(READY_MARKER, DEADLINE).rsplit(" ", 1)[-1] for s in shards]
        workers = [
            Child(
                f"{tag}-worker-{i}",
                [
                    "worker",
                    "--server",
                    ",".join(addresses),
                    "--device",
                    "cpu",
                    "--name",
                    f"w{i}",
                    "--step-delay",
                    "0.01",
                    "--server-timeout",
                    "120",
                    "--rpc-timeout",
                    "30",
                ],
                tmp_path / f"{tag}-worker-{i}.log",
            )
            for i in range(WORKERS)
        ]
        procs += workers
        if every:
            newest = _kill_every_shard(shards, tmp_path / tag, addresses)
            assert max(newest) < ROUNDS // 2, "the run went too fast to crash it mid-run"
            for i, address in enumerate(addresses):
                port = int(address.rsplit(":", 1)[1])
                procs.append(_shard(tmp_path, tag, i, port, 2, policy, what))
            for again in procs[-SHARDS:]:
                again.wait_for_line(READY_MARKER, DEADLINE)
        elif crash:
            # Past the cut at round 10, before the end: kill -9 shard 1, no last checkpoint.
            killed_at = (kill or _kill_past_a_cut)(shards[1], tmp_path / tag, addresses)
            assert killed_at < ROUNDS // 2, "the run went too fast to crash it mid-run"
            port = int(addresses[1].rsplit(":", 1)[1])
            again = _shard(tmp_path, tag, 1, port, 2, policy, what)
            procs.append(again)
            again.wait_for_line(READY_MARKER, DEADLINE)
        for w in workers:
            assert w.proc.wait(DEADLINE) == 0, w.tail(30)
        if at_end:  # the last worker's leaving cuts at the run's end (round 96; cuts: 5s)
            deadline = time.monotonic() + DEADLINE
            while ROUNDS not in checkpoint.list_cuts(tmp_path / tag, 1, SHARDS):
                assert time.monotonic() < deadline, "no cut at the run's end"
                time.sleep(0.05)  # polling another process's writes; bounded
            os.kill(shards[1].proc.pid, signal.SIGKILL)
            shards[1].proc.wait(DEADLINE)
            port = int(addresses[1].rsplit(":", 1)[1])
            procs.append(_shard(tmp_path, tag, 1, port, 2, policy, what))
            procs[-1].wait_for_line(READY_MARKER, DEADLINE)
        model = models.resolve(what[0])()
        manifest = layout.Manifest.from_tensors(models.parameters(model))
        parts, statuses = [], []
        channels = [connect(address, DEADLINE) for address in addresses]
        for i, (address, channel) in enumerate(zip(addresses, channels, strict=True)):
            lo, hi = layout.shard_range(manifest.numel, i, SHARDS)
            _, part = observe(channel, 4 * (hi - lo))
            parts.append(part.copy())
            st = _status(address)
            assert st is not None
            statuses.append(st)
        observers = [Observer(Stub(c), a) for c, a in zip(channels, addresses, strict=True)]
        specs = models.table_specs(model)
        tables = RemoteTables(observers, specs, rpc_timeout=30)
        parts += [tables.read_all(s.name).numpy().ravel() for s in specs]
        for channel in channels:
            channel.close()
        if every:
            assert any("rewinding" in w.log_path.read_text() for w in workers)
        if crash and not every:
            assert any("rewinding" in w.log_path.read_text() for w in workers)
            # shard 0 went back from where it was to the round shard 1 resumed from: its
            # newest cut on disk when it was killed
            rewound = re.search(
                r"rewound from round (\d+) to the cut at round (\d+)",
                shards[0].log_path.read_text(),
            )
            assert rewound is not None, shards[0].tail(30)
            assert int(rewound[2]) == killed_at < int(rewound[1])
        return np.concatenate(parts), statuses
    finally:
        stop_all(procs)


def _kill_past_a_cut(shard: Child, directory, addresses: list[str]) -> int:
    """kill -9 shard 1 at a moment when shard 0 is past shard 1's newest cut on disk (round
    10 or later), so that the restarted shard 1 must bring shard 0 back to that cut. Each
    look stops shard 1 (SIGSTOP) so that it cannot write a newer cut meanwhile; when shard 0
    is not past the cut yet, shard 1 goes on (SIGCONT) and the test looks again. Returns the
    cut."""
    channel = connect(addresses[0], DEADLINE)  # one channel: a connect takes about 0.2 s
    try:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            if _clock(Stub(channel).Status(pb.StatusRequest(), timeout=10)) < 13:
                time.sleep(0.01)  # polling another process; bounded by the deadline
                continue
            os.kill(shard.proc.pid, signal.SIGSTOP)
            cut = max(checkpoint.list_cuts(directory, 1, SHARDS), default=0)
            if cut >= 10 and _clock(Stub(channel).Status(pb.StatusRequest(), timeout=10)) > cut:
                os.kill(shard.proc.pid, signal.SIGKILL)
                shard.proc.wait(DEADLINE)
                return cut
            os.kill(shard.proc.pid, signal.SIGCONT)
            time.sleep(0.01)  # let the run go on a little
    finally:
        channel.close()
    raise AssertionError("shard 0 never got past shard 1's newest cut")


def _kill_while_its_writes_fail(
    shard: Child, directory, addresses: list[str], also: Child | None = None
) -> int:
    """Make every write of shard 1 fail (a file-size limit set on the running process, as a
    full disk would) while shard 0 writes as usual, then kill -9 shard 1 once its cuts
    wait in memory (the run waits for them) or shard 0 ran far past shard 1's newest cut
    on disk (what happened before the cuts taken were bounded). Returns that cut."""
    _, hard = resource.prlimit(shard.proc.pid, resource.RLIMIT_FSIZE)
    channel = connect(addresses[0], DEADLINE)
    try:
        deadline = time.monotonic() + DEADLINE
        while _clock(Stub(channel).Status(pb.StatusRequest(), timeout=10)) < 10:
            assert time.monotonic() < deadline, "the run did not reach round 10"
            time.sleep(0.01)  # polling another process; bounded by the deadline
        resource.prlimit(shard.proc.pid, resource.RLIMIT_FSIZE, (4096, hard))
        while True:
            assert time.monotonic() < deadline, "shard 1's writes never failed"
            mine = _status(addresses[1])
            cut = max(checkpoint.list_cuts(directory, 1, SHARDS), default=0)
            ahead = _clock(Stub(channel).Status(pb.StatusRequest(), timeout=10)) - cut
            if (
                mine is not None
                and mine.checkpoint_failures > 0
                and (mine.cuts_pending >= 2 or ahead > 5 * CUT_EVERY)
            ):
                break
            time.sleep(0.05)  # polling; bounded by the deadline
        for victim in (shard, also) if also is not None else (shard,):
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(DEADLINE)
        return max(checkpoint.list_cuts(directory, 1, SHARDS))
    finally:
        channel.close()


def _kill_every_shard(shards: list[Child], directory, addresses: list[str]) -> list[int]:
    """kill -9 every shard at once, at a moment shard 1's writes fail (so shard 0 has newer
    cuts on disk than shard 1); each shard's newest cut on disk then."""
    _kill_while_its_writes_fail(shards[1], directory, addresses, also=shards[0])
    newest = [max(checkpoint.list_cuts(directory, i, SHARDS)) for i in range(SHARDS)]
    assert newest[0] > newest[1], newest  # shard 0 must go back to shard 1's cut
    return newest


def _clock(st: pb.StatusResponse) -> int:
    """The slowest live worker's clock (under sync, the round)."""
    return min((w.clock for w in st.workers), default=0)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> np.ndarray:
    """The MLP's sync run uninterrupted, which four tests compare with: run once (a sync
    run over shards is the same to the bit each time, as the test of a shard killed after
    the run's end asserts)."""
    weights, _ = _run(tmp_path_factory.mktemp("uninterrupted"), "clean", crash=False)
    return weights


def test_a_sharded_run_whose_shard_is_killed_ends_as_an_uninterrupted_run(tmp_path, clean):
    crashed, statuses = _run(tmp_path, "crash", crash=True)
    for st in statuses:
        assert st.rounds == ROUNDS  # both shards end at the same round
    assert statuses[0].batches_done == ROUNDS * WORKERS  # every batch, once
    print(f"largest difference from the uninterrupted run: {np.abs(crashed - clean).max():.3g}")
    np.testing.assert_allclose(crashed, clean, rtol=1e-6, atol=1e-7)


def test_a_shard_killed_after_the_run_ended_resumes_at_its_end(tmp_path, clean):
    """Round 96 is past the last scheduled cut (95): the last worker's leaving cuts there,
    so a shard killed after the run resumes at its end, with nobody left to train again."""
    ended, statuses = _run(tmp_path, "ended", crash=False, at_end=True)
    assert ROUNDS % CUT_EVERY and [st.rounds for st in statuses] == [ROUNDS, ROUNDS]
    np.testing.assert_array_equal(ended, clean)


def test_a_sharded_run_whose_slow_shard_is_killed_keeps_a_common_cut(tmp_path, clean):
    """Nothing lost when shards crash: shard 1's writes
    fail while shard 0's succeed; shard 0 deletes no cut that shard 1 may restart from, and
    shard 1's cuts waiting for its disk are bounded (the run waits for them). kill -9 of
    shard 1 then, and a restart: the run recovers and ends as an uninterrupted run."""
    _ends_as_an_uninterrupted_run(tmp_path, clean, "slow", kill=_kill_while_its_writes_fail)


def test_a_sharded_run_whose_every_shard_is_killed_at_once_ends_as_an_uninterrupted_run(
    tmp_path, clean
):
    """Every shard killed at once (shard 1's writes failing, so its newest cut is older than
    shard 0's) restarts from its own newest cut; the workers bring shard 0 back to shard
    1's (which it keeps: guarantee 2 of "Recovery that never loses or doubles work"), and
    the run ends as an uninterrupted one."""
    _ends_as_an_uninterrupted_run(tmp_path, clean, "every", every=True)


def _ends_as_an_uninterrupted_run(tmp_path, clean: np.ndarray, tag: str, **crash) -> None:
    """A sync run crashed as ``crash`` says ends at the last round with every batch once and
    the weights of the same run uninterrupted (``clean``)."""
    crashed, statuses = _run(tmp_path, f"{tag}-crash", crash=True, **crash)
    for st in statuses:
        assert st.rounds == ROUNDS
    assert statuses[0].batches_done == ROUNDS * WORKERS
    np.testing.assert_allclose(crashed, clean, rtol=1e-6, atol=1e-7)


def test_a_sharded_async_run_whose_shard_is_killed_applies_every_batch_once_on_both(tmp_path):
    _, statuses = _run(tmp_path, "async", crash=True, policy="async")
    batches = ROUNDS * WORKERS
    assert statuses[0].batches_done == batches
    for st in statuses:  # both ranges hold the same updates: one per batch of the run
        assert st.pushes_applied == st.version == batches


def test_a_sharded_run_with_tables_whose_shard_is_killed_ends_as_an_uninterrupted_run(tmp_path):
    """The cuts hold each shard's rows of the tables and their sync round: after the crash
    and the rewind, the dense part and every table end as in the uninterrupted run. The
    rows come back from a base and the deltas after it (``server/disk/row_format.py``): the
    restarted shard read at least one delta, and so did shard 0's rewind."""
    clean, _ = _run(tmp_path, "tables-clean", crash=False, what=TABLES)
    crashed, statuses = _run(tmp_path, "tables-crash", crash=True, what=TABLES)
    for log_name in ("tables-crash-shard1-2.log", "tables-crash-shard0-1.log"):
        restored = re.findall(
            r"restored from .*: a base and (\d+) deltas", (tmp_path / log_name).read_text()
        )
        assert restored and int(restored[-1]) >= 1, (log_name, restored)
    for st in statuses:
        assert st.rounds == ROUNDS
        assert st.rows_held > 0
    assert statuses[0].batches_done == ROUNDS * WORKERS
    np.testing.assert_allclose(crashed, clean, rtol=1e-6, atol=1e-7)
