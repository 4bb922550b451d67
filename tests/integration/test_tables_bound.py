"""Rows keep the staleness bound: under ``ssp:K`` a row a worker prefetched is fetched again
before an iteration it would be too old for (it carries the slowest live clock when it was
read), so no row it computes with misses a push the policy says it must see."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

import paramserver as ps
from tests.conftest import DEADLINE, WorkerThread

ROW = 7


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 4, sparse=True), nn.Flatten(), nn.Linear(4, 1))


def _clock_reaches(server: ps.ServerApp, worker_id: str, clock: int) -> None:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        clocks = {w["worker_id"]: w["clock"] for w in server.status()["workers"]}
        if clocks.get(worker_id, -1) >= clock:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{worker_id} never reached clock {clock}")


@pytest.mark.parametrize(("policy", "fetched_again"), [("ssp:1", True), ("async", False)])
def test_a_row_prefetched_too_long_ago_is_fetched_again(serve, policy, fetched_again):
    server = serve(model(), optimizer="sgd", lr=1.0, policy=policy, workers=2)
    a_model, b_model = model(), model()
    joining = [
        WorkerThread(lambda m=m, n=n: ps.Worker(server.address, m, name=n), name=n)
        for m, n in ((a_model, "a"), (b_model, "b"))
    ]
    for t in joining:
        t.start()
    a, b = (t.result() for t in joining)
    used: dict[str, torch.Tensor] = {}

    def worker_a() -> None:
        a_model(torch.tensor([[1]])).sum().backward()
        a.step(samples=1)  # clock 1; B is at 0
        a.prefetch({"0": [ROW]})  # read while the slowest clock is 0
        a_model(torch.tensor([[2]])).sum().backward()
        a.step(samples=1)  # clock 2: its pull waits for B's first push (ssp:1)
        with torch.no_grad():
            used["row"] = a_model[0](torch.tensor([ROW])).clone()  # what iteration 2 uses

    try:
        thread = WorkerThread(worker_a, name="a-steps")
        thread.start()
        _clock_reaches(server, a.worker_id, 2)
        b_model(torch.tensor([[ROW]])).sum().backward()
        b.step(samples=1)  # B's iteration 0 changes the row A prefetched
        thread.result()
    finally:
        a.close()
        b.close()
    now = server.coordinator.tables.table("0").read(np.array([ROW]))
    if fetched_again:  # A's iteration 2 must see B's iteration 0 (2 - 0 > K)
        torch.testing.assert_close(used["row"], now)
        assert a.tables.counters.refetched == 1
    else:  # async bounds nothing: the row A read before B's push is used as it was
        assert not torch.allclose(used["row"], now)
        assert a.tables.counters.refetched == 0
