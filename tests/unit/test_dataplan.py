"""The batch queue: every batch of the run is applied exactly once, whatever the membership does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.dataplan import BatchQueue


def test_batches_go_out_in_order_and_a_retry_gets_the_same_one() -> None:
    q = BatchQueue(per_epoch=3, epochs=2)
    assert [q.take("a", 0), q.take("b", 0), q.take("a", 1)] == [0, 1, 2]
    assert q.take("a", 1) == 2  # a retried pull
    assert q.complete("a", 0) == 0 and q.done == 1
    assert q.complete("a", 0) is None and q.done == 1  # a duplicate push completes nothing


def test_a_departed_workers_batches_go_first_to_the_next_taker() -> None:
    q = BatchQueue(per_epoch=4, epochs=1)
    q.take("a", 0), q.take("b", 0), q.take("a", 1)
    assert sorted(q.release("a")) == [0, 2]
    assert [q.take("c", 0), q.take("c", 1), q.take("c", 2)] == [0, 2, 3]
    assert q.take("c", 3) is None and q.exhausted and not q.finished


def test_state_returns_batches_in_flight() -> None:
    q = BatchQueue(per_epoch=5, epochs=1)
    q.take("a", 0), q.take("b", 0)
    q.complete("a", 0)
    back = BatchQueue.from_state(q.state())
    assert (back.done, back.next_batch, back.returned) == (1, 2, [1])
    assert back.take("z", 7) == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "complete", "leave"]), st.integers(0, 3)),
                max_size=200))  # fmt: skip
def test_any_interleaving_applies_each_batch_at_most_once_and_loses_none(ops) -> None:
    q = BatchQueue(per_epoch=7, epochs=3)
    clocks = {f"w{i}": 0 for i in range(4)}
    applied: list[int] = []
    for op, i in ops:
        w = f"w{i}"
        if op == "take":
            q.take(w, clocks[w])
        elif op == "complete" and clocks[w] in q.taken.get(w, {}):
            applied.append(q.complete(w, clocks[w]))
            clocks[w] += 1
        elif op == "leave":
            q.release(w)
            clocks[w] += 100  # a new member
    # Drain: one worker finishes the run.
    t = 10_000
    while (b := q.take("drain", t)) is not None:
        applied.append(q.complete("drain", t))
        t += 1
    for w in list(q.taken):
        q.release(w)
    while (b := q.take("drain", t)) is not None:
        applied.append(q.complete("drain", t))
        t += 1
    assert b is None
    assert sorted(applied) == list(range(q.total))
    assert q.finished
