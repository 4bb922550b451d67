"""The built-in worker's loop with overlapped local steps (``trainer._train_overlapped``),
over a scripted stand-in for the worker: each push carries exactly the progress trained on
the batches it names, and a round trained ahead on batches the worker no longer holds (it
rejoined, the server rewound) is dropped, never pushed under another round's name."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

import paramserver as ps
from paramserver.training.trainer import _train_overlapped


class _Scripted:
    """A worker whose pulls answer from ``answers``: (batches, next_batches, finished)."""

    overlap, tables, rank, batch = False, None, 0, None

    def __init__(self, answers: list[tuple[list[int], list[int], bool]]):
        self.model = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.model.weight.zero_()
        self.answers = list(answers)
        self.batches, self.next_batches, self.finished = self.answers.pop(0)
        self.pushed: list[tuple[list[int], float | None]] = []
        self.ahead = False

    def name_next_batches(self) -> None:
        self.ahead = True

    def landed_batches(self) -> list[tuple[int, ...]]:
        return []

    def step(self, samples: int = 0, loss: float = math.nan, empty: bool = False) -> None:
        grad = None if empty else float(self.model.weight.grad)
        self.pushed.append(([] if empty else list(self.batches), grad))
        if self.model.weight.grad is not None:
            self.model.weight.grad.zero_()
        self.batches, self.next_batches, self.finished = self.answers.pop(0)


def test_each_push_carries_the_progress_of_its_batches_and_a_stale_round_is_dropped():
    worker = _Scripted(
        [
            ([0, 1], [], False),  # the first pull names nothing ahead
            ([2, 3], [4, 5], False),
            ([4, 5], [6, 7], False),
            ([9, 10], [], False),  # rejoined: [6, 7], trained ahead, is not this worker's
            ([], [], True),
        ]
    )
    local = ps.LocalSteps(worker, overlap=True)
    trained = []

    def compute(todo: list[int]) -> tuple[int, float]:
        trained.append(list(todo))
        with torch.no_grad():  # progress that names its batches: their sum + 1
            local.model.weight.add_(sum(todo) + 1)
        local.merge()
        return 64 * len(todo), 0.0

    cfg = SimpleNamespace(batch_log=None, max_steps=None, step_delay=0.0, rpc_timeout=5.0)
    steps, samples, empty = _train_overlapped(cfg, worker, local, compute)
    assert worker.ahead
    assert trained == [[0, 1], [2, 3], [4, 5], [6, 7], [9, 10]]
    # the pseudo-gradient is the anchor minus the weights: minus each round's own progress
    assert worker.pushed == [([0, 1], -2.0), ([2, 3], -6.0), ([4, 5], -10.0), ([9, 10], -20.0)]
    assert (steps, samples, empty) == (4, 4 * 128, 0)
    assert not local.flight.in_flight


def test_an_empty_sync_round_counts_in_and_max_steps_ends_the_loop():
    worker = _Scripted(
        [
            ([0], [], False),
            ([], [], False),  # sync: none left for this round
            ([1], [2], False),
            ([2], [3], False),
            ([3], [], False),
        ]
    )
    local = ps.LocalSteps(worker, overlap=True)

    def compute(todo: list[int]) -> tuple[int, float]:
        with torch.no_grad():
            local.model.weight.add_(sum(todo) + 1)
        return 64, 0.0

    cfg = SimpleNamespace(batch_log=None, max_steps=3, step_delay=0.0, rpc_timeout=5.0)
    steps, samples, empty = _train_overlapped(cfg, worker, local, compute)
    assert (steps, empty) == (3, 1)
    assert worker.pushed == [([0], -1.0), ([], None), ([1], -2.0), ([2], -3.0)]
    assert not local.flight.in_flight  # landed before leaving
