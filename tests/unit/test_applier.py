"""The optimizer's own thread (``--optimizer-thread``): pushes run there, in order, and their
results and errors come back to the caller."""

from __future__ import annotations

import threading

import pytest

from paramserver.errors import InvalidRequest
from paramserver.server.doors.optimizer_thread import Applier, call


def test_jobs_run_on_the_applier_thread_in_order_and_return_their_results():
    applier = Applier()
    seen: list[tuple[int, str]] = []

    def job(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * i

    try:
        assert [applier.run(job, i) for i in range(5)] == [0, 1, 4, 9, 16]
    finally:
        applier.close()
    assert [i for i, _ in seen] == list(range(5))
    assert {name for _, name in seen} == {"ps-applier"}


def test_an_error_reaches_the_caller_and_the_thread_goes_on():
    applier = Applier()

    def refuse() -> None:
        raise InvalidRequest("bad push")

    try:
        with pytest.raises(InvalidRequest, match="bad push"):
            applier.run(refuse)
        assert applier.run(call, len, "abc") == 3
    finally:
        applier.close()


def test_concurrent_callers_each_get_their_own_result():
    applier = Applier()
    results: dict[int, int] = {}
    lock = threading.Lock()

    def caller(i: int) -> None:
        value = applier.run(lambda: i + 100)
        with lock:
            results[i] = value

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
            assert not t.is_alive()
    finally:
        applier.close()
    assert results == {i: i + 100 for i in range(8)}


def test_after_close_a_job_runs_on_the_callers_thread():
    applier = Applier()
    applier.close()
    applier.close()  # twice is fine
    assert applier.run(lambda: threading.current_thread().name) == threading.current_thread().name
