"""Pure decisions of the staleness policies."""

from __future__ import annotations

import pytest

from paramserver.errors import ConfigError
from paramserver.policy.staleness import (
    Policy,
    PushAction,
    push_action,
    round_complete,
    staleness,
)


@pytest.mark.parametrize(
    ("text", "bound", "name"),
    [
        ("sync", 0, "sync"),
        ("async", None, "async"),
        ("delay-1", 1, "ssp:1"),
        ("delay-3", 3, "ssp:3"),
        ("ssp:1", 1, "ssp:1"),
        ("ssp:3", 3, "ssp:3"),
        ("SYNC", 0, "sync"),
        ("  Async\n", None, "async"),
        (" SSP:2 ", 2, "ssp:2"),
        ("Delay-4", 4, "ssp:4"),
    ],
)
def test_parse_valid(text: str, bound: int | None, name: str) -> None:
    policy = Policy.parse(text)
    assert policy.bound == bound
    assert policy.name == name
    # The canonical name parses back to the same policy.
    assert Policy.parse(policy.name) == policy


@pytest.mark.parametrize("text", ["ssp:0", "delay-0", "ssp:x", "bogus", "", "ssp:-1", "delay"])
def test_parse_invalid_names_the_text(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        Policy.parse(text)
    assert repr(text) in str(info.value)


def test_parse_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        Policy.parse("bogus")


@pytest.mark.parametrize(
    ("text", "synchronous"),
    [("sync", True), ("ssp:1", False), ("ssp:3", False), ("async", False)],
)
def test_synchronous(text: str, synchronous: bool) -> None:
    assert Policy.parse(text).synchronous is synchronous


@pytest.mark.parametrize(
    ("iteration", "rounds_done", "ready"),
    [(0, 0, True), (1, 0, False), (1, 1, True), (2, 1, False), (3, 5, True)],
)
def test_pull_ready_sync_follows_rounds(iteration: int, rounds_done: int, ready: bool) -> None:
    sync = Policy.parse("sync")
    # min_clock is irrelevant under sync: only the rounds applied count.
    for min_clock in (None, 0, 10):
        assert sync.pull_ready(iteration, min_clock, rounds_done) is ready


@pytest.mark.parametrize(
    ("k", "iteration", "min_clock", "ready"),
    [
        (1, 0, 0, True),
        (1, 1, 0, True),
        (1, 2, 0, False),
        (1, 2, 1, True),
        (1, 5, 3, False),
        (1, 5, 4, True),
        (3, 3, 0, True),
        (3, 4, 0, False),
        (3, 4, 1, True),
        (3, 10, None, True),
        (1, 10, None, True),
    ],
)
def test_pull_ready_ssp(k: int, iteration: int, min_clock: int | None, ready: bool) -> None:
    policy = Policy.parse(f"ssp:{k}")
    assert policy.pull_ready(iteration, min_clock, rounds_done=0) is ready


@pytest.mark.parametrize("min_clock", [None, 0, 7])
def test_pull_ready_async_always(min_clock: int | None) -> None:
    policy = Policy.parse("async")
    for iteration in (0, 1, 100, 10_000):
        assert policy.pull_ready(iteration, min_clock, rounds_done=0) is True


@pytest.mark.parametrize(
    ("iteration", "min_clock", "expected"),
    [(5, None, 0), (5, 5, 0), (5, 2, 3), (2, 5, 0), (0, 0, 0), (10, 0, 10)],
)
def test_staleness(iteration: int, min_clock: int | None, expected: int) -> None:
    assert staleness(iteration, min_clock) == expected


@pytest.mark.parametrize(
    ("iteration", "clock", "action"),
    [
        (3, 3, PushAction.APPLY),
        (0, 0, PushAction.APPLY),
        (2, 3, PushAction.DUPLICATE),
        (1, 3, PushAction.PAST),
        (0, 3, PushAction.PAST),
        (4, 3, PushAction.AHEAD),
        (9, 0, PushAction.AHEAD),
    ],
)
def test_push_action(iteration: int, clock: int, action: PushAction) -> None:
    assert push_action(iteration, clock) is action


def test_push_window_accepts_retries_of_every_push_in_flight() -> None:
    assert push_action(1, 3, window=2) is PushAction.DUPLICATE
    assert push_action(0, 3, window=2) is PushAction.PAST


def test_round_complete() -> None:
    assert round_complete({"a", "b"}, ["a", "b"]) is True
    assert round_complete({"a"}, ["a", "b"]) is False
    # A departed contributor's gradient still counts; live workers must all contribute.
    assert round_complete({"a", "gone"}, ["a"]) is True
    # Nobody contributed: never complete, even when nobody is live.
    assert round_complete(set(), []) is False
    assert round_complete(set(), ["a"]) is False
    # Contributors but nobody live any more: complete.
    assert round_complete({"a"}, []) is True


@pytest.mark.parametrize(
    ("text", "inflight"),
    [("sync", 1), ("ssp:1", 1), ("delay-1", 1), ("ssp:2", 2), ("ssp:3", 2), ("async", 2)],
)
def test_max_inflight_pushes(text: str, inflight: int) -> None:
    assert Policy.parse(text).max_inflight_pushes() == inflight
