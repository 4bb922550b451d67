"""The batch queue: every batch of the run is applied exactly once, whatever the membership does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.server.bookkeeping.batch_queue import BatchQueue


def test_batches_go_out_in_order_and_a_retry_gets_the_same_one() -> None:
    q = BatchQueue(per_epoch=3, epochs=2)
    assert [q.take("a", 0), q.take("b", 0), q.take("a", 1)] == [[0], [1], [2]]
    assert q.take("a", 1) == [2]  # a retried pull
    assert q.complete("a", 0) == [0] and q.done == 1
    assert q.complete("a", 0) == [] and q.done == 1  # a duplicate push completes nothing


def test_push_every_k_takes_k_batches_an_iteration_and_fewer_at_the_end() -> None:
    q = BatchQueue(per_epoch=5, epochs=1)
    assert q.take("a", 0, count=2) == [0, 1]
    assert q.take("a", 0, count=2) == [0, 1]  # a retried pull
    assert q.take("b", 0, count=4) == [2, 3, 4]  # what is left
    assert q.take("c", 0, count=2) == [] and q.exhausted
    assert q.complete("b", 0) == [2, 3, 4] and q.done == 3
    assert sorted(q.release("a")) == [0, 1]
    assert q.take("c", 0, count=3) == [0, 1]


def test_a_departed_workers_batches_go_first_to_the_next_taker() -> None:
    q = BatchQueue(per_epoch=4, epochs=1)
    q.take("a", 0), q.take("b", 0), q.take("a", 1)
    assert sorted(q.release("a")) == [0, 2]
    assert [q.take("c", 0), q.take("c", 1), q.take("c", 2)] == [[0], [2], [3]]
    assert q.take("c", 3) == [] and q.exhausted and not q.finished


def test_state_returns_batches_in_flight() -> None:
    q = BatchQueue(per_epoch=5, epochs=1)
    q.take("a", 0), q.take("b", 0, count=2)
    q.complete("a", 0)
    back = BatchQueue.from_state(q.state())
    assert (back.done, back.next_batch, back.returned) == (1, 3, [(1, 2)])
    assert back.take("z", 7) == [1, 2]  # one push's batches go out again together
    old = {**q.state(), "groups": None}  # a checkpoint of before groups: one batch each
    del old["groups"]
    assert BatchQueue.from_state(old).returned == [(1,), (2,)]


def test_a_group_goes_out_again_whole_and_an_empty_push_gives_its_batches_back() -> None:
    q = BatchQueue(per_epoch=6, epochs=1)
    assert q.take("a", 0, count=3) == [0, 1, 2]
    assert q.take("b", 0, count=2) == [3, 4]
    q.release("a")
    assert q.take("c", 0, count=1) == [0, 1, 2]  # whole, though c asks for fewer
    assert q.give_back("b", 0) == [3, 4] and q.done == 0
    assert q.take("c", 1, count=5) == [3, 4]  # not mixed with fresh batches


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["take", "ahead", "complete", "leave"]), st.integers(0, 3)),
        max_size=200,
    )
)
def test_any_interleaving_applies_each_batch_at_most_once_and_loses_none(ops) -> None:
    q = BatchQueue(per_epoch=7, epochs=3)
    clocks = {f"w{i}": 0 for i in range(4)}
    applied: list[int] = []
    for op, i in ops:
        w = f"w{i}"
        if op == "take":
            q.take(w, clocks[w], count=1 + i % 3)  # workers with --push-every 1, 2 and 3
        elif op == "ahead":  # a pull that names the next iteration's batches too
            q.take(w, clocks[w], count=1 + i % 3)
            q.take(w, clocks[w] + 1, count=1 + i % 3)
        elif op == "complete" and clocks[w] in q.taken.get(w, {}):
            applied += q.complete(w, clocks[w])
            clocks[w] += 1
        elif op == "leave":
            q.release(w)
            clocks[w] += 100  # a new member
    # Drain: one worker finishes the run.
    t = 10_000
    while b := q.take("drain", t):
        applied += q.complete("drain", t)
        t += 1
    for w in list(q.taken):
        q.release(w)
    while b := q.take("drain", t, count=2):
        applied += q.complete("drain", t)
        t += 1
    assert b == []
    assert sorted(applied) == list(range(q.total))
    assert q.finished


def test_a_worker_holds_a_batch_before_an_iteration_until_it_pushes_it():
    q = BatchQueue(per_epoch=2, epochs=1)
    assert q.take("a", 0) == [0]
    assert q.holds_before("a", 1) and not q.holds_before("a", 0)
    assert not q.holds_before("b", 5)
    q.complete("a", 0)
    assert not q.holds_before("a", 1)
