"""The processes of ``bench sparse``'s Criteo case: its cases, its samples, and each way of
training or serving its DLRM (``model.py``).

- ``python -m paramserver.bench.criteo.ranks RANK WORLD PORT CASE MODE ADDRESS STEPS DATA
  OUT`` (PORT unused; DATA: the case's training samples, saved by the bench): a paramserver
  worker (``ps.Worker``) that trains batches RANK, RANK+WORLD, ... of one epoch (at most
  STEPS of them; 0: all) of the model with its tables as MODE says (declared: each batch's
  rows of all 26 tables prefetched in one request, ``Worker.prefetch``, as the worker
  daemon does for a model with ``table_ids``), and writes its figures
  to OUT: samples, seconds, rows fetched and pushed, the flat buffer's size, peak RSS.
- ``python -m paramserver.bench.criteo.ranks serve CASE SNAPSHOT OUT``: a fresh process that
  loads a serving snapshot (``paramserver.serving.load``) and answers one batch, timed from
  before ``load`` to the answer, then the test AUC of the served model.
- ``local_run``: the same model and samples in one process: its tables declared and trained
  on their own with the servers' row optimizer (``model.ROWS``), Adam on the rest at the
  same lr.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paramserver.bench.criteo import stream as criteo
from paramserver.bench.criteo.model import LR, QUICK_DIVISOR, build
from paramserver.bench.ddp import peak_rss_mb, worker_figures, write_result
from paramserver.sparse import name_tables
from paramserver.training.evaluation import evaluate


@dataclass(frozen=True)
class CriteoCase:
    """One epoch of ``train`` samples of the stream at ``cards``' cardinalities, batch
    ``batch``; the same tables dense for ``dense_steps`` steps of one worker."""

    name: str
    divisor: int  # the cardinalities divided by this
    train: int
    test: int
    batch: int
    dense_steps: int
    factory: str = "paramserver.bench.criteo.model:full"  # for paramserver export --model

    @property
    def cards(self) -> tuple[int, ...]:
        return criteo.scaled(self.divisor) if self.divisor > 1 else criteo.CARDINALITIES


CASES = {
    c.name: c
    for c in (
        # 33.8M rows x 16 declared (2.0 GiB); 1M samples; the same tables dense: 2 GiB a
        # step each way, one worker (two do not fit this machine's 24 GiB beside the
        # server's Adam), about 7 s a step here: 24 steps (24,576 samples, 3 minutes) for
        # its rate and its AUC
        CriteoCase("criteo", 1, 1_000_000, 100_000, 1024, dense_steps=24),
        CriteoCase(
            "quick-criteo",
            QUICK_DIVISOR,
            32_768,
            8_192,
            1024,
            dense_steps=4,
            factory="paramserver.bench.criteo.model:quick",
        ),
    )
}


@cache
def data(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    case = CASES[name]
    return criteo.make(case.train, case.test, seed=0, cards=case.cards)


def auc(model: nn.Module, test_x: torch.Tensor, test_y: torch.Tensor) -> float:
    return float(evaluate(model, test_x, test_y).auc or float("nan"))


def batches(case: CriteoCase, rank: int = 0, world: int = 1) -> list[slice]:
    """This rank's batches of the epoch, in order."""
    return [
        slice(b * case.batch, (b + 1) * case.batch)
        for b in range(rank, case.train // case.batch, world)
    ]


def local_run(case: CriteoCase) -> dict[str, Any]:
    """One process, every batch of the epoch in order: samples/s and test AUC, and the AUC
    after the dense tables' run's samples (its ``dense_steps`` batches)."""
    torch.set_num_threads(1)
    train_x, train_y, test_x, test_y = data(case.name)
    model = build(case.cards, "declared")
    name_tables(model)  # the rows a cluster starts from
    opt = torch.optim.Adam(model.parameters(), lr=LR)  # the tables step themselves
    mine = batches(case)
    seconds, early = 0.0, float("nan")
    for step, part in enumerate(mine, start=1):
        started = time.perf_counter()
        F.cross_entropy(model(train_x[part]), train_y[part]).backward()
        opt.step()
        opt.zero_grad()
        seconds += time.perf_counter() - started
        if step == case.dense_steps:  # as far as the dense tables' run goes (untimed)
            early = auc(model, test_x, test_y)
    return {
        "samples": len(mine) * case.batch,
        "seconds": seconds,
        "auc": auc(model, test_x, test_y),
        "auc_at_dense_steps": early,
    }


def ps_main(argv: list[str]) -> None:
    from paramserver.worker.worker import Worker

    rank, world = int(argv[0]), int(argv[1])
    case, mode, address = CASES[argv[3]], argv[4], argv[5]
    max_steps, saved, out = int(argv[6]), argv[7], argv[8]
    torch.set_num_threads(1)
    train_x, train_y = torch.load(saved)
    model = build(case.cards, mode, init=False)  # the servers' weights start it
    mine = batches(case, rank, world)[: max_steps or None]
    with Worker(address, model, name=f"criteo-{rank}") as worker:
        started, cpu_started = time.perf_counter(), time.process_time()
        for part in mine:
            if mode == "declared":  # every table's rows in one request, not one a table
                worker.prefetch(model.table_ids(train_x[part]))
            F.cross_entropy(model(train_x[part]), train_y[part]).backward()
            worker.step(samples=case.batch)
        worker.flush()
        figures = worker_figures(worker, rank, len(mine), case.batch, started, cpu_started)
    write_result(out, {**figures, "peak_rss_mb": peak_rss_mb()})


def serve_main(argv: list[str]) -> None:
    """Load the snapshot, answer one batch of the test set (timed), then the test AUC."""
    case, snapshot, out = CASES[argv[0]], Path(argv[1]), argv[2]
    torch.set_num_threads(1)
    from paramserver.serving import load

    test_x, test_y = criteo.samples(case.test, 0, case.cards, stream=1)
    one = test_x[: case.batch]
    started = time.perf_counter()
    model = load(snapshot)
    with torch.no_grad():
        answer = model(one)
    first = time.perf_counter() - started
    assert answer.shape == (len(one), 2)
    write_result(out, {"first_answer_seconds": first, "auc": auc(model, test_x, test_y)})


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve_main(sys.argv[2:])
    else:
        ps_main(sys.argv[1:])
