"""Which batches each worker computes: the server hands out the run's batches, one or (with
``--push-every K``) K per iteration.

Batch g of a run is batch ``g % per_epoch`` of epoch ``g // per_epoch``: a slice of that
epoch's seeded permutation (``data.batch_indices``), which every worker can compute. The
queue gives each batch to exactly one worker at a time; a batch taken by a worker that
dies or leaves before pushing it goes back to the queue and is handed out again first. So
whatever the membership does, every batch of every epoch is applied exactly once, and a
worker that joins mid-run simply starts taking batches.

Batches handed out again go out as they went first: a group of K batches (one push's worth)
stays one group, so a shard that already applied that push's gradient finds every batch of
it applied or none (``server/bookkeeping/ledger.py``).

Pure bookkeeping, no threads: the coordinator serialises calls.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from paramserver.errors import InvalidRequest


@dataclass
class BatchQueue:
    """The batches of a run, handed out to (worker, iteration) pairs.

    Args:
        per_epoch: batches per epoch (training samples // batch size).
        epochs: passes over the training set.
    """

    per_epoch: int
    epochs: int
    next_batch: int = 0  # the first batch never handed out
    done: int = 0
    # a heap of groups (each one push's batches), handed out again first, each whole
    returned: list[tuple[int, ...]] = field(default_factory=list)
    # worker -> iteration -> the batches it computes then
    taken: dict[str, dict[int, list[int]]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.per_epoch * self.epochs

    @property
    def finished(self) -> bool:
        """Every batch of the run has been applied."""
        return self.done >= self.total

    @property
    def exhausted(self) -> bool:
        """Nothing left to hand out now (batches may still be in flight)."""
        return not self.returned and self.next_batch >= self.total

    def take(self, worker_id: str, iteration: int, count: int = 1) -> list[int]:
        """The batches (up to ``count``; a group handed out again goes whole) ``worker_id``
        computes at ``iteration``; empty when none is left now.

        Asking again for the same (worker, iteration) gives the same batches (a retried pull).
        """
        mine = self.taken.setdefault(worker_id, {})
        if iteration in mine:
            return mine[iteration]
        batches: list[int] = []
        if self.returned:
            batches = list(heapq.heappop(self.returned))
        if not batches and self.next_batch < self.total:
            take = min(count, self.total - self.next_batch)
            batches = list(range(self.next_batch, self.next_batch + take))
            self.next_batch += take
        if batches:
            mine[iteration] = batches
        return batches

    def holds_before(self, worker_id: str, iteration: int) -> bool:
        """Whether ``worker_id`` holds batches of an iteration before ``iteration`` that it
        has not pushed (a prefetching worker pulls t+1 before it pushes t)."""
        return any(t < iteration for t in self.taken.get(worker_id, {}))

    def complete(self, worker_id: str, iteration: int) -> list[int]:
        """The push of ``iteration`` was applied: its batches are done. Returns them."""
        batches = self.taken.get(worker_id, {}).pop(iteration, [])
        self.done += len(batches)
        return batches

    def _give_back(self, groups: list[list[int]]) -> list[int]:
        for group in groups:
            heapq.heappush(self.returned, tuple(group))
        return [b for g in groups for b in g]

    def release(self, worker_id: str) -> list[int]:
        """The worker is gone: the batches it took and did not push go back to the queue."""
        return self._give_back(list(self.taken.pop(worker_id, {}).values()))

    def release_from(self, worker_id: str, iteration: int) -> list[int]:
        """Give back the worker's batches of ``iteration`` and later (it rewound its clock)."""
        mine = self.taken.get(worker_id, {})
        return self._give_back([mine.pop(t) for t in sorted(mine) if t >= iteration])

    def give_back(self, worker_id: str, iteration: int) -> list[int]:
        """The worker pushed no gradient for ``iteration`` (an empty push): its batches of
        that iteration go back to the queue."""
        group = self.taken.get(worker_id, {}).pop(iteration, [])
        return self._give_back([group] if group else [])

    @classmethod
    def plan(
        cls, queue: BatchQueue | None, train_samples: int, batch_size: int, epochs: int
    ) -> BatchQueue | None:
        """The run's queue once a worker says how many samples it trains on: ``queue`` if
        there is one already (checked against this worker's data), else a new one.

        Raises:
            InvalidRequest: a negative count, too few samples for a batch, or a data set
                whose size differs from the one the run's batches come from.
        """
        if train_samples < 0:
            raise InvalidRequest(f"train_samples {train_samples} is negative.")
        if not train_samples:
            return queue
        per_epoch = train_samples // batch_size
        if per_epoch < 1:
            raise InvalidRequest(
                f"{train_samples} training samples do not make one batch of {batch_size}."
            )
        if queue is None:
            return cls(per_epoch, epochs)
        if queue.per_epoch != per_epoch:
            raise InvalidRequest(
                f"This worker's data set has {train_samples} training samples, {per_epoch} "
                f"batches of {batch_size}; the run hands out {queue.per_epoch} batches per "
                "epoch. Give every worker the same data."
            )
        return queue

    def state(self) -> dict[str, Any]:
        """For a checkpoint: batches in flight count as returned (their pushes are not in it).
        ``returned`` lists them all; ``groups`` as they go out again."""
        in_flight = [tuple(bs) for m in self.taken.values() for bs in m.values()]
        groups = sorted(list(self.returned) + in_flight)
        return {
            "per_epoch": self.per_epoch,
            "epochs": self.epochs,
            "next_batch": self.next_batch,
            "done": self.done,
            "returned": sorted(b for g in groups for b in g),
            "groups": [list(g) for g in groups],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> BatchQueue:
        return cls(
            per_epoch=int(state["per_epoch"]),
            epochs=int(state["epochs"]),
            next_batch=int(state["next_batch"]),
            done=int(state["done"]),
            returned=sorted(
                tuple(int(b) for b in g)
                for g in state.get("groups", [[b] for b in state["returned"]])
            ),
        )
