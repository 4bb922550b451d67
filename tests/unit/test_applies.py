"""The dense apply runs off the coordinator's lock (server/engine/dense_apply.py): a pull is answered
from the last published version while an apply is held, and reports that version exactly;
under ssp:K it waits for the pushes its bound needs to be applied, not merely accepted;
gradients that arrive during an apply are summed into one step with --coalesce on (each
counted once), or stepped one by one with it off; a retry of a push still being applied is a
duplicate; a checkpoint's state holds every push its clocks count; a rewind drops what was
not applied and its pushers are told to join again."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.errors import ParamServerError, Timeout, WrongIncarnation
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.engine.coordinator import Coordinator

N = 8
DEADLINE = 10.0


class Held:
    """Holds the store's optimizer steps: ``entered`` is set when one starts, it runs once
    ``release`` is set; counts the steps."""

    def __init__(self, store: ParameterStore):
        self.entered, self.release = threading.Event(), threading.Event()
        self.steps = 0
        self._step = store.step
        store.step = self.step  # type: ignore[method-assign]

    def step(
        self, grad: np.ndarray, lr: float, idle: tuple = (), clip: float | None = None
    ) -> None:
        self.steps += 1
        self.entered.set()
        assert self.release.wait(DEADLINE), "the test never released the apply"
        self._step(grad, lr, idle, clip)


def _coordinator(policy: str = "async", coalesce: str = "off", workers: int = 2) -> Coordinator:
    manifest = Manifest.from_tensors([("w", torch.zeros(N))])
    opt = OptimizerConfig("sgd", lr=1.0)
    store = ParameterStore(manifest, np.zeros(N, np.float32), opt)
    config = ServerConfig(policy=policy, workers=workers, optimizer=opt, coalesce=coalesce)
    return Coordinator(config, store)


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn(*args)
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _grad(value: float) -> np.ndarray:
    return np.full(N, value, np.float32)


def _joined(c: Coordinator, n: int = 2) -> list[str]:
    return [c.join(f"w{i}").worker_id for i in range(n)]


def test_a_pull_returns_the_published_version_while_an_apply_is_held():
    c = _coordinator()
    a, b = _joined(c)
    c.push(a, 0, _grad(1.0), 1, 0.0)
    assert c.pull(b, 0, 1.0).version == 1  # pulls are recent: an apply keeps their version
    held = Held(c.store)
    pusher, out = _in_thread(c.push, a, 1, _grad(2.0), 1, 0.0)
    assert held.entered.wait(DEADLINE)
    result = c.pull(b, 1, 1.0)  # returns while the apply is held
    assert result.version == 1 and np.array_equal(result.weights, _grad(-1.0))
    observed = c.pull("", 0, 1.0)
    assert observed.version == 1 and np.array_equal(observed.weights, _grad(-1.0))
    assert pusher.is_alive()  # the apply is still held
    held.release.set()
    pusher.join(DEADLINE)
    assert out["result"].version == 2 and not out["result"].duplicate
    after = c.pull(b, 2, 1.0)
    assert after.version == 2 and np.array_equal(after.weights, _grad(-3.0))


def test_a_shared_segment_pull_is_written_from_the_published_version_during_an_apply():
    c = _coordinator()
    a, b = _joined(c)
    c.push(a, 0, _grad(1.0), 1, 0.0)
    c.pull(b, 0, 1.0)
    held = Held(c.store)
    pusher, _ = _in_thread(c.push, a, 1, _grad(2.0), 1, 0.0)
    assert held.entered.wait(DEADLINE)
    written: list[np.ndarray] = []
    result = c.pull(b, 1, 1.0, sink=lambda w: written.append(w.copy()))
    assert result.version == 1 and np.array_equal(written[0], _grad(-1.0))
    held.release.set()
    pusher.join(DEADLINE)


def test_under_ssp_a_pull_waits_for_the_pushes_its_bound_needs_to_be_applied():
    c = _coordinator("ssp:1")
    a, b = _joined(c)
    c.push(b, 0, _grad(1.0), 1, 0.0)
    c.pull(b, 1, 1.0)
    c.push(b, 1, _grad(1.0), 1, 0.0)  # b's clock is 2, a's 0
    held = Held(c.store)
    pusher, _ = _in_thread(c.push, a, 0, _grad(1.0), 1, 0.0)  # a's clock is 1, not applied
    assert held.entered.wait(DEADLINE)
    assert c.membership.min_clock() == 1  # accepted: the bound would let b pull iteration 2
    with pytest.raises(Timeout):
        c.pull(b, 2, 0.05)  # but the weights do not hold a's push yet
    waiting, out = _in_thread(c.pull, b, 2, DEADLINE)
    held.release.set()
    waiting.join(DEADLINE)
    pusher.join(DEADLINE)
    assert out["result"].version == 3 and out["result"].staleness == 1


@pytest.mark.parametrize("coalesce,steps", [("on", 2), ("off", 4)])
def test_pushes_that_arrive_during_an_apply_are_summed_into_one_step(coalesce, steps):
    c = _coordinator(coalesce=coalesce, workers=4)
    ids = _joined(c, 4)
    held = Held(c.store)
    first, _ = _in_thread(c.push, ids[0], 0, _grad(1.0), 1, 0.0)
    assert held.entered.wait(DEADLINE)
    others = [_in_thread(c.push, w, 0, _grad(float(i + 2)), 1, 0.0) for i, w in enumerate(ids[1:])]
    assert c.wait_for(lambda c: len(c.applies.pending) == 3, DEADLINE)
    held.release.set()
    for t, _ in [(first, None), *others]:
        t.join(DEADLINE)
    assert all("error" not in out for _, out in others)
    assert held.steps == steps
    status = c.status()
    assert status.version == 4 and status.pushes_applied == 4 and status.samples == 4
    assert [c.membership.get(w).clock for w in ids] == [1, 1, 1, 1]
    # SGD at lr 1: the sum in one step is the four steps' result
    assert np.array_equal(c.store.weights, _grad(-(1.0 + 2.0 + 3.0 + 4.0)))
    assert status.pushes_coalesced == (3 if coalesce == "on" else 0)


def test_a_retry_of_a_push_being_applied_is_a_duplicate_and_applies_nothing_more():
    c = _coordinator()
    a, _ = _joined(c)
    held = Held(c.store)
    pusher, out = _in_thread(c.push, a, 0, _grad(1.0), 1, 0.0)
    assert held.entered.wait(DEADLINE)
    retry = c.push(a, 0, _grad(1.0), 1, 0.0)
    assert retry.duplicate
    held.release.set()
    pusher.join(DEADLINE)
    assert held.steps == 1 and c.store.version == 1
    assert np.array_equal(c.store.weights, _grad(-1.0))


def test_a_checkpoint_state_holds_every_push_its_clocks_count():
    c = _coordinator()
    a, b = _joined(c)
    held = Held(c.store)
    first, _ = _in_thread(c.push, a, 0, _grad(1.0), 1, 0.0)
    assert held.entered.wait(DEADLINE)
    second, _ = _in_thread(c.push, b, 0, _grad(2.0), 1, 0.0)
    assert c.wait_for(lambda c: len(c.applies.pending) == 1, DEADLINE)
    saving, out = _in_thread(c.checkpoint_state)
    held.release.set()
    for t in (first, second, saving):
        t.join(DEADLINE)
    state = out["result"]
    assert state.version == 2 and sorted(m["clock"] for m in state.members) == [1, 1]
    assert np.array_equal(state.weights, _grad(-3.0))


def test_a_rewind_drops_the_pushes_not_yet_applied_and_their_pushers_join_again():
    c = _coordinator()
    a, b = _joined(c)
    start = c.checkpoint_state()
    held = Held(c.store)
    first, _ = _in_thread(c.push, a, 0, _grad(1.0), 1, 0.0)
    assert held.entered.wait(DEADLINE)
    second, out = _in_thread(c.push, b, 0, _grad(2.0), 1, 0.0)
    assert c.wait_for(lambda c: len(c.applies.pending) == 1, DEADLINE)
    rewinding, _ = _in_thread(c.rewind, start, [])
    held.release.set()
    for t in (first, second, rewinding):
        t.join(DEADLINE)
    assert isinstance(out.get("error"), WrongIncarnation) or held.steps == 2
    assert c.store.version == 0 and np.array_equal(c.store.weights, _grad(0.0))


def test_a_push_answered_before_its_apply_gives_its_buffer_back_once_applied():
    """A push that may be answered early (the data port's, alone) is answered once accepted;
    the applier thread applies it and then gives its buffer back. At most MAX_AHEAD wait
    so: the next push is answered once applied, as any other."""
    c = _coordinator(workers=3)
    a, b, d = _joined(c, 3)
    held = Held(c.store)
    released: list[str] = []

    def keep(name: str):
        def kept():
            assert name != "d", "a third push was answered before it was applied"
            return lambda: released.append(name)

        return kept

    first = c.push(a, 0, _grad(1.0), 1, 0.0, keep=keep("a"))
    assert first.version == 0 and first.clock == 1 and not first.duplicate
    assert held.entered.wait(DEADLINE)  # the applier thread has it
    second = c.push(b, 0, _grad(2.0), 1, 0.0, keep=keep("b"))  # answered, waits pending
    assert second.clock == 1 and c.applies.ahead == 2 and released == []
    third, out = _in_thread(lambda: c.push(d, 0, _grad(4.0), 1, 0.0, keep=keep("d")))
    assert c.wait_for(lambda c: len(c.applies.pending) == 2, DEADLINE)
    assert third.is_alive()  # past MAX_AHEAD: answered once applied
    held.release.set()
    third.join(DEADLINE)
    assert out["result"].version >= 2
    assert c.wait_for(lambda c: c.store.version == 3 and c.applies.idle, DEADLINE)
    # d's buffer was never kept: its caller gives it back when the push returns
    assert sorted(released) == ["a", "b"] and c.applies.ahead == 0
    assert np.array_equal(c.store.weights, _grad(-7.0))
    c.applies.close()


def _failing_on(c: Coordinator, value: float) -> None:
    """The optimizer's step raises (as out of memory would) on gradients of ``value``."""
    real = c.store.step

    def step(grad: np.ndarray, lr: float, idle: tuple = (), clip: float | None = None) -> None:
        if grad[0] == value:
            raise MemoryError("no room for the step")
        real(grad, lr, idle, clip)

    c.store.step = step  # type: ignore[method-assign]


def test_a_step_that_raises_loses_only_the_gradients_it_did_not_apply():
    c = _coordinator()
    a, b = _joined(c)
    _failing_on(c, 2.0)
    c.push(a, 0, _grad(1.0), 1, 0.0)
    with pytest.raises(ParamServerError, match="failed to apply"):
        c.push(b, 0, _grad(2.0), 1, 0.0)
    status = c.status()
    assert status.version == 1 and status.apply_failures == 1
    assert c.applies.idle and not c.applies.unpublished
    c.push(b, 1, _grad(3.0), 1, 0.0)  # and the run goes on
    assert c.store.version == 2 and np.array_equal(c.store.weights, _grad(-4.0))


def test_a_checkpoint_whose_drain_fails_still_publishes_and_leaves_nothing_running():
    c = _coordinator()
    a, _ = _joined(c)
    _failing_on(c, 2.0)
    with c._cond:  # a gradient accepted and left pending
        c.applies.add(a, _grad(2.0))
    state = c.checkpoint_state()
    assert state.version == 0 and c.applies.idle and not c.applies.unpublished
    assert c.status().apply_failures == 1
    assert c.pull(a, 0, 1.0).version == 0  # a pull still has its answer


def _two_pending_behind_a_held_apply(c: Coordinator) -> tuple[list[str], Held, list]:
    """Three workers: the first one's push held in its apply, the other two's pending
    behind it (summed into one step once it is released, with --coalesce on)."""
    ids = _joined(c, 3)
    held = Held(c.store)
    threads = [_in_thread(c.push, ids[0], 0, _grad(1.0), 1, 0.0)]
    assert held.entered.wait(DEADLINE)
    threads += [
        _in_thread(c.push, w, 0, _grad(v), 1, 0.0) for w, v in zip(ids[1:], (2.0, 4.0), strict=True)
    ]
    assert c.wait_for(lambda c: len(c.applies.pending) == 2, DEADLINE)
    return ids, held, threads


def test_with_coalescing_a_retry_of_a_summed_push_is_a_duplicate_and_each_counts_once():
    c = _coordinator(coalesce="on", workers=3)
    ids, held, threads = _two_pending_behind_a_held_apply(c)
    retry = _in_thread(c.push, ids[1], 0, _grad(2.0), 1, 0.0)  # its reply was lost
    held.release.set()
    for t, _ in [*threads, retry]:
        t.join(DEADLINE)
    assert retry[1]["result"].duplicate and all("error" not in out for _, out in threads)
    assert held.steps == 2  # the first push alone, then the two pending summed
    status = c.status()
    assert status.version == 3 and status.pushes_applied == 3 and status.samples == 3
    assert status.duplicates == 1 and status.pushes_coalesced == 2
    assert [c.membership.get(w).clock for w in ids] == [1, 1, 1]
    assert np.array_equal(c.store.weights, _grad(-7.0))


def test_with_coalescing_a_checkpoint_state_holds_every_push_its_clocks_count():
    c = _coordinator(coalesce="on", workers=3)
    _, held, threads = _two_pending_behind_a_held_apply(c)
    saving, out = _in_thread(c.checkpoint_state)
    held.release.set()
    for t, _ in [*threads, (saving, None)]:
        t.join(DEADLINE)
    state = out["result"]
    assert state.version == 3 and sorted(m["clock"] for m in state.members) == [1, 1, 1]
    assert np.array_equal(state.weights, _grad(-7.0))
    assert c.status().pushes_coalesced == 2


def test_with_coalescing_a_rewind_drops_the_summed_pushes_not_yet_applied():
    c = _coordinator(coalesce="on", workers=3)
    start = c.checkpoint_state()
    _, held, threads = _two_pending_behind_a_held_apply(c)
    rewinding, _ = _in_thread(c.rewind, start, [])
    held.release.set()
    for t, _ in [*threads, (rewinding, None)]:
        t.join(DEADLINE)
    for _, out in threads[1:]:  # refused (join again), or applied before the rewind
        assert isinstance(out.get("error"), WrongIncarnation) or held.steps == 2
    assert c.store.version == 0 and np.array_equal(c.store.weights, _grad(0.0))


def test_with_coalescing_under_ssp_a_pull_waits_for_the_summed_pushes_its_bound_needs():
    c = _coordinator("ssp:1", coalesce="on", workers=4)
    a, b, d, e = _joined(c, 4)
    c.push(d, 0, _grad(1.0), 1, 0.0)
    c.pull(d, 1, 1.0)
    c.push(d, 1, _grad(1.0), 1, 0.0)  # d's clock is 2, the others' 0
    held = Held(c.store)
    first, _ = _in_thread(c.push, e, 0, _grad(1.0), 1, 0.0)
    assert held.entered.wait(DEADLINE)
    others = [_in_thread(c.push, w, 0, _grad(1.0), 1, 0.0) for w in (a, b)]
    assert c.wait_for(lambda c: len(c.applies.pending) == 2, DEADLINE)
    assert c.membership.min_clock() == 1  # accepted: the bound would let d pull iteration 2
    with pytest.raises(Timeout):
        c.pull(d, 2, 0.05)  # but the weights do not hold those pushes yet
    waiting, out = _in_thread(c.pull, d, 2, DEADLINE)
    held.release.set()
    for t, _ in [(first, None), *others, (waiting, None)]:
        t.join(DEADLINE)
    assert held.steps == 2 and c.status().pushes_coalesced == 2  # e's, then a's and b's
    assert out["result"].version == 5 and out["result"].staleness == 1
