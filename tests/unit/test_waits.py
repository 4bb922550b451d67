"""Waits said aloud (paramserver/worker/waits.py) and the heartbeat thread that says them:
a wait is reported once per period while it lasts, with the server's reason, and the
thread survives a round that raises."""

from __future__ import annotations

import threading

from paramserver._proto import paramserver_pb2 as pb
from paramserver.worker.session import Heartbeats
from paramserver.worker.waits import Waits, explain
from tests.conftest import DEADLINE, FakeClock


def test_a_wait_is_due_once_a_period_while_it_lasts():
    clock = FakeClock()
    waits = Waits(every=10.0, now=clock)
    assert waits.due() == []
    with waits.waiting("the pull of iteration 3"):
        clock.advance(9.9)
        assert waits.due() == []
        clock.advance(0.2)
        assert waits.due() == [("the pull of iteration 3", 10.100000000000023)]
        assert waits.due() == []  # reported: not again until another period
        clock.advance(10.0)
        assert [w for w, _ in waits.due()] == ["the pull of iteration 3"]
    clock.advance(30.0)
    assert waits.due() == []  # over: never reported again


def _status(live: int, minimum: int, version: int, **kw) -> pb.StatusResponse:
    kw.setdefault("checkpoint_failing_seconds", -1.0)  # the server's "not failing"
    workers = [pb.WorkerStatus(worker_id=str(i), clock=5 + i) for i in range(live)]
    return pb.StatusResponse(
        workers=workers, min_workers=minimum, version=version, policy="ssp:1", **kw
    )


def test_the_reason_is_the_servers():
    assert "the run has not started: 1 of 3 workers are live" in explain(_status(1, 3, 0))
    # after the start the server no longer waits for --min-workers: slower workers it is
    later = explain(_status(1, 3, 40))
    assert "not started" not in later and "the slowest live clock is 5" in later
    assert "is over" in explain(_status(2, 2, 9, batches_done=4, batches_total=4))
    failing = _status(2, 2, 9, checkpoint_failing_seconds=12.0, cuts_pending=2)
    assert "checkpoint writes have failed for 12s and 2 cuts wait" in explain(failing)
    assert "checkpoint" not in explain(_status(2, 2, 9))


def test_the_heartbeat_thread_survives_a_round_that_raises():
    stop = threading.Event()
    rounds: list[int] = []
    beaten = threading.Event()

    class Flaky:
        lease_seconds = 0.15

        def heartbeat_once(self, timeout: float) -> None:
            rounds.append(1)
            if len(rounds) <= 2:
                raise ValueError("a closed channel")
            beaten.set()

        def report_waits(self, timeout: float) -> None:
            assert timeout <= 2 * Flaky.lease_seconds / 3 + 1e-9

    beats = Heartbeats([Flaky()], stop).start()  # type: ignore[list-item]
    try:
        assert beaten.wait(DEADLINE), rounds
        assert beats.failures == 2 and beats.alive
    finally:
        stop.set()
        beats.join(DEADLINE)
    assert not beats.alive
