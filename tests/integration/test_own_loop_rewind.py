"""A user's own-data loop told that the server restarted behind it (issue 56, must 9): a
server killed with kill -9 comes back from its last checkpoint, which lacks the loop's last
steps. ``worker.step()`` rejoins it, then raises ``ps.ServerRewound`` once, naming the step
the server holds (the checkpoint's) and how many of the loop's steps are not in the model,
so the loop redoes its data from there; the steps after it count as usual. Before, step()
returned normally and the lost steps were never known."""

from __future__ import annotations

import os
import signal

import pytest

import paramserver as ps
from paramserver import models
from paramserver.cluster.procs import READY_MARKER, Child, stop_all
from tests.conftest import DEADLINE, ones_step, wait_until


def _server(tmp_path, port: int, n: int) -> Child:
    args = ["server", "--host", "127.0.0.1", "--port", str(port), "--model", "mlp"]
    args += ["--policy", "async", "--workers", "1", "--optimizer", "sgd", "--lr", "0.01"]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "5"]
    args += ["--run-dir", "off", "--lease-timeout", "5"]
    return Child(f"server-{n}", args, tmp_path / f"server-{n}.log", capture_stdout=True)


def test_a_loop_with_its_own_data_is_told_which_steps_a_restart_lost(tmp_path):
    procs: list[Child] = []
    try:
        first = _server(tmp_path, 0, 1)
        procs.append(first)
        address = first.wait_for_line(READY_MARKER, DEADLINE).rsplit(" ", 1)[-1]
        model = models.build("mlp", seed=0)
        with ps.Worker(address, model, overlap=False, rpc_timeout=10) as worker:
            for _ in range(5):
                ones_step(worker, model)
            wait_until(lambda: worker.status().checkpoint_version == 5, "the checkpoint of 5")
            for _ in range(3):  # not in any checkpoint
                ones_step(worker, model)
            os.kill(first.proc.pid, signal.SIGKILL)
            first.proc.wait(DEADLINE)
            second = _server(tmp_path, int(address.rsplit(":", 1)[1]), 2)
            procs.append(second)
            second.wait_for_line(READY_MARKER, DEADLINE)
            with pytest.raises(ps.ServerRewound, match="goes on from step 5") as told:
                ones_step(worker, model)  # its push meets the new server: dropped
            assert (told.value.step, told.value.lost) == (5, 4)  # 3 steps, and this one
            assert worker.clock == 5
            for _ in range(2):  # the loop redoes its data from step 5
                ones_step(worker, model)
            assert worker.status().version == 7
    finally:
        stop_all(procs)
