"""deploy/slurm/paramserver.sbatch on a real Slurm (``tests/slurm.py``: munged, slurmctld and
two slurmd started here, stopped afterwards): the heterogeneous job trains to the end and
its shards write their last checkpoint; a requeued job resumes from it and applies every
batch exactly once; the torchx component runs on torchx's Slurm scheduler. Skips, saying why, only where the daemons cannot start."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from paramserver.server.disk import checkpoint
from tests import slurm
from tests.integration.test_torchx import free_ports

# Slurm's daemons: one such test at a time under `make test`'s processes.
pytestmark = pytest.mark.xdist_group("slurm")

SBATCH = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "paramserver.sbatch"
BATCHES = 4096 // 64  # synthetic data, batch 64
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL")


@pytest.fixture(scope="module")
def cluster() -> Iterator[slurm.Cluster]:
    why = slurm.unavailable()
    if why:
        pytest.skip(why)
    # Not pytest's tmp_path: its folders are private to root, and munged runs as munge.
    home = Path(tempfile.mkdtemp(prefix="paramserver-slurm-"))
    try:
        c = slurm.Cluster(home)  # installed but failing to start: an error, not a skip
        yield c
        c.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def submit(cluster: slurm.Cluster, workdir: Path, **settings: str) -> str:
    env = {
        **cluster.env,
        # not the job's default 50051: other tests' servers on this host bind ports beside it
        "PARAMSERVER_PORT": str(free_ports(2)),  # and the data port above it
        "PARAMSERVER_CMD": f"{sys.executable} -m paramserver",
        "PARAMSERVER_DATASET": "synthetic",
        "PARAMSERVER_DEVICE": "cpu",
        **settings,
    }
    workdir.mkdir()
    out = cluster.run_env(
        ["sbatch", "--parsable", "--export=ALL", f"--chdir={workdir}", str(SBATCH)], env
    )
    return out.strip().split(";")[0]


def job(cluster: slurm.Cluster, jid: str) -> dict[str, str]:
    """The leader component's fields (``scontrol show job``)."""
    text = cluster.run(["scontrol", "show", "job", jid]).split("\n\n")[0]
    return dict(re.findall(r"(\w+)=(\S*)", text))


def wait(what: str, check, deadline: float):
    end = time.monotonic() + deadline
    while not (value := check()):
        assert time.monotonic() < end, f"{what}: not within {deadline:.0f} s"
        time.sleep(0.5)  # polling slurmctld; bounded by the deadline
    return value


def saved_version(directory: Path) -> int:
    path = directory / checkpoint.SERVER_FILE
    return int(checkpoint.load(path)["version"]) if path.exists() else -1


def test_the_heterogeneous_job_trains_to_the_end(cluster, tmp_path):
    started = time.monotonic()
    port = free_ports(2)
    jid = submit(cluster, tmp_path / "run", PARAMSERVER_EPOCHS="2", PARAMSERVER_PORT=str(port))
    state = wait(
        "the job done",
        lambda: (j := job(cluster, jid))["JobState"] in ("COMPLETED", "FAILED", "CANCELLED") and j,
        240,
    )
    log = (tmp_path / "run" / f"paramserver-{jid}.out").read_text()
    assert state["JobState"] == "COMPLETED", log[-3000:]
    assert f"1 shard(s) at 127.0.0.1:{port}, 2 worker(s)" in log
    # both workers finished, between them every batch of 2 epochs of 64 once (the server
    # hands batches to whoever asks, so a faster worker may take one or two more)
    steps = [int(n) for n in re.findall(r"rank \d finished: (\d+) steps", log)]
    assert len(steps) == 2 and sum(steps) == 2 * BATCHES, steps
    assert "SIGTERM received: stopping" in log  # the shard stopped cleanly...
    assert saved_version(tmp_path / "run" / f"paramserver-{jid}") == 2 * BATCHES  # ...and saved
    print(f"slurm job: {time.monotonic() - started:.1f} s from sbatch to COMPLETED")


def test_a_requeued_job_resumes_from_its_checkpoint(cluster, tmp_path):
    jid = submit(
        cluster,
        tmp_path / "run",
        PARAMSERVER_EPOCHS="4",
        PARAMSERVER_STEP_DELAY="0.1",
        PARAMSERVER_CHECKPOINT_EVERY="10",
        PARAMSERVER_LEASE_TIMEOUT="5",
    )
    ckpt = tmp_path / "run" / f"paramserver-{jid}"
    reached = wait("a checkpoint mid-run", lambda: (v := saved_version(ckpt)) >= 40 and v, 240)
    assert reached < 4 * BATCHES
    started = time.monotonic()
    cluster.run(["scontrol", "requeue", jid])
    # Slurm holds a requeued batch job back for a while (Reason=BeginTime); an operator's
    # "scontrol update StartTime=now" lets it run at once, which is all this test waits for.
    pending = wait(
        "the job requeued", lambda: (j := job(cluster, jid))["JobState"] == "PENDING" and j, 120
    )
    print(
        f"slurm requeue: pending with Reason={pending.get('Reason')} until {pending.get('StartTime')}"
    )
    cluster.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"])
    state = wait(
        "the requeued job done",
        lambda: (
            (j := job(cluster, jid))["JobState"] in ("COMPLETED", "FAILED", "CANCELLED")
            and j["Restarts"] != "0"
            and j
        ),
        300,
    )
    log = (tmp_path / "run" / f"paramserver-{jid}.out").read_text()
    assert state["JobState"] == "COMPLETED", log[-3000:]
    assert "(restart 1)" in log and "resumed from incarnation" in log
    saved = checkpoint.load(ckpt / checkpoint.SERVER_FILE)
    # delay-1 applies every push: one optimizer step per batch, each batch exactly once
    assert saved["version"] == 4 * BATCHES
    assert saved["counters"]["samples"] == 4 * BATCHES * 64
    print(
        f"slurm requeue: resumed at version >= {reached}, done {time.monotonic() - started:.1f} s "
        "after scontrol requeue"
    )


def test_the_torchx_component_trains_to_the_end_on_slurm(cluster, tmp_path, monkeypatch):
    """paramserver.launchers.torchx on torchx's Slurm scheduler: each replica its own
    heterogeneous group, and Slurm gives each group nodes of its own, so one shard and one
    worker on the two nodes. The worker dials the shard's node (n1 and n2 are not host
    names here: its NodeAddr); the shard exits once the run is over. Submitted with
    torchx's Python API: its CLI, after submitting, asks squeue for the job's state and
    fails on this Slurm (22.05) while the job is pending (KeyError 'job_resources')."""
    from torchx.runner import get_runner

    work = tmp_path / "torchx"
    work.mkdir()
    monkeypatch.chdir(work)  # the scheduler writes the replicas' logs here
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    port = free_ports(2)
    args = ["--workers", "1", "--shards", "1", "--port", str(port), "--device", "cpu"]
    args += ["--memMB", "0", "--", "--dataset", "synthetic", "--epochs", "1", "--run-dir", "off"]
    with get_runner() as runner:
        handle = runner.run_component("paramserver.launchers.torchx:paramserver", args, "slurm")
    jid = handle.rsplit("/", 1)[-1]

    def states() -> list[str]:
        text = cluster.run(["scontrol", "show", "job", jid], check=False)
        found = re.findall(r"JobState=(\w+)", text)
        return found if found and all(s in ENDED for s in found) else []

    ended = wait("the torchx job done", states, 240)
    logs = {f.name: f.read_text() for f in work.glob(f"slurm-{jid}-*.err")}
    assert ended == ["COMPLETED"] * 2, logs
    server, worker = logs[f"slurm-{jid}-server-0.err"], logs[f"slurm-{jid}-worker-0.err"]
    assert "every worker has left: stopping (--exit-when-done)" in server
    assert re.findall(r"rank 0 finished: (\d+) steps", worker) == [str(BATCHES)], worker[-2000:]
    assert f"joined 127.0.0.1:{port} as" in worker  # the shard's NodeAddr and port
