"""The processes of ``bench sparse``: the cases, the model, and each way of training it.

- ``python -m paramserver.bench.tables.ranks RANK WORLD PORT ps ADDRESS CASE MODE STEPS
  DATA OUT`` (PORT unused; DATA: the case's training samples, saved by the bench):
  a paramserver worker (the Python API, ``ps.Worker``) that trains batches RANK, RANK+WORLD,
  ... of the case's click log (at most STEPS of them; 0: all), its table as MODE says
  (``build_model``), and writes its figures to OUT: samples, seconds, rows fetched and
  pushed, the flat buffer's size, and its peak resident memory.
- ``python -m paramserver.bench.tables.ranks RANK WORLD PORT CASE OUT`` (``run_ranks``'s
  form): one rank of torch DDP (gloo) with the table as a sparse embedding (its gradients
  all-reduced sparse) under SparseAdam, the rest under Adam; rank 0 also writes the AUC.
- ``local_run``: the same model and samples in one process, the same optimizers.

The model is ``models.DLRM`` with one shared table of ``fields x rows`` rows (``shared``):
a sparse ``nn.Embedding`` whose pages are never touched, a dense one, or a declared
``paramserver.sparse.Embedding`` (allocated nowhere), with or without a lifecycle. So a
table larger than a worker's memory never takes its memory there: the worker's table is
the servers' rows and a bounded cache.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paramserver import models
from paramserver.sparse import Embedding, Lifecycle, name_tables
from paramserver.sparse.tableset import row_optimizer
from paramserver.training import clicks
from paramserver.training.evaluation import evaluate

LR = 0.01
MODES = ("sparse", "dense", "declared", "lifecycle")
ADMIT_AFTER = 2  # the lifecycle run: ids admitted at their second push


@dataclass(frozen=True)
class Case:
    """One table of ``fields * rows`` rows x ``dim``, trained for one epoch of ``train``
    samples in batches of ``batch``; ids Zipf(``zipf``) per field (0: uniform)."""

    name: str
    fields: int
    rows: int  # per field
    dim: int
    train: int
    test: int
    batch: int
    zipf: float = clicks.ZIPF
    optimizer: str = "adam"  # the servers' (and the baselines') optimizer
    dense_steps: int = 0  # steps per worker of the same table as a dense parameter (0: none)
    cache_rows: int = 1 << 16
    capacity_share: int = 8  # the lifecycle run's capacity: this fraction of the table

    @property
    def table_rows(self) -> int:
        return self.fields * self.rows

    @property
    def table_mb(self) -> float:
        return self.table_rows * self.dim * 4 / 2**20

    @property
    def row_bytes(self) -> int:
        return self.dim * 4 + 8  # its values and its id on the wire

    @property
    def lifecycle(self) -> Lifecycle:
        return Lifecycle(admit_after=ADMIT_AFTER, capacity=self.table_rows // self.capacity_share)


CASES = {
    c.name: c
    for c in (
        # 1M rows x 64 (256 MB): tables against the same table dense, local and DDP; the
        # lifecycle run holds 62,500 rows (the run touches about 278,000, 113,000 twice)
        Case("main", 8, 125_000, 64, 200_000, 20_000, 256, dense_steps=8, capacity_share=16),
        # 32M rows x 64 declared (8 GiB), uniform ids: about 1.1 GB of rows come to exist
        Case(
            "big",
            8,
            4 << 20,
            64,
            600_000,
            5_000,
            2048,
            zipf=0.0,
            optimizer="sgd",
            cache_rows=1 << 15,
        ),
        # a push holds about 400 distinct rows: a capacity of half the table holds two
        Case("quick-main", 4, 500, 8, 8_192, 2_048, 256, dense_steps=4, capacity_share=2),
        Case("quick-big", 4, 4_000, 32, 8_192, 1_024, 512, zipf=0.0, optimizer="sgd"),
    )
}


def data(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return clicks.make(
        case.train, case.test, seed=0, fields=case.fields, rows=case.rows, zipf=case.zipf
    )


def build_model(case: Case, mode: str) -> nn.Module:
    """The case's DLRM, seeded, its table as ``mode`` says: "sparse", an ``nn.Embedding``
    with ``sparse=True`` initialised N(0, 1) (the servers start from its rows); "dense",
    the same without; "declared", a
    ``paramserver.sparse.Embedding``; "lifecycle", the same with ``case.lifecycle``."""
    if mode not in MODES:
        raise ValueError(f"A table mode is one of {MODES}; got {mode!r}.")
    torch.manual_seed(0)
    model = models.DLRM(case.fields, 1, case.dim, sparse=mode != "dense", shared=True)
    model.rows = case.rows  # field f's ids start at f * rows
    if mode in ("declared", "lifecycle"):
        life = case.lifecycle if mode == "lifecycle" else None
        model.tables[0] = Embedding(case.table_rows, case.dim, lifecycle=life)
        return model
    weight = torch.empty(case.table_rows, case.dim)
    nn.init.normal_(weight)  # a table starts from its module's rows (the servers load them)
    model.tables[0] = nn.Embedding(
        case.table_rows, case.dim, sparse=mode != "dense", _weight=weight
    )
    return model


def optimizers(model: nn.Module, case: Case) -> list[torch.optim.Optimizer]:
    """What the servers do, locally: the table row-wise (lazy adam or sgd), the rest dense."""
    table = [p for n, p in model.named_parameters() if n.startswith("tables.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    if case.optimizer == "adam":  # a declared table has no parameter: its store steps it
        sparse = [torch.optim.SparseAdam(table, lr=LR)] if table else []
        return [*sparse, torch.optim.Adam(rest, lr=LR)]
    return [torch.optim.SGD(table + rest, lr=LR)]


def auc(model: nn.Module, test_x: torch.Tensor, test_y: torch.Tensor) -> float:
    return float(evaluate(model, test_x, test_y).auc or float("nan"))


def local_run(case: Case, rows: bool = False) -> dict[str, Any]:
    """One process, every batch of the epoch in order: samples/s and test AUC. ``rows``:
    the table declared (``paramserver.sparse.Embedding``) and trained on its own with the
    servers' row optimizer (for adam: sparse-adam, as torch's ``SparseAdam`` but from the
    declared table's own initial rows), the rest as before."""
    torch.set_num_threads(1)
    train_x, train_y, test_x, test_y = data(case)
    torch.manual_seed(0)
    model = models.DLRM(case.fields, case.rows, case.dim, sparse=True, shared=True)
    if rows:
        rows_by = row_optimizer(case.optimizer, LR).name  # what the servers run for it
        model.tables[0] = Embedding(case.table_rows, case.dim, optimizer=rows_by, lr=LR)
        name_tables(model)
    opts = optimizers(model, case)
    batches = case.train // case.batch
    started = time.perf_counter()
    for b in range(batches):
        part = slice(b * case.batch, (b + 1) * case.batch)
        F.cross_entropy(model(train_x[part]), train_y[part]).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    seconds = time.perf_counter() - started
    return {"samples": batches * case.batch, "seconds": seconds, "auc": auc(model, test_x, test_y)}


def ps_main(argv: list[str]) -> None:
    from paramserver.bench.ddp import peak_rss_mb, worker_figures, write_result
    from paramserver.worker.worker import Worker

    rank, world, address, name = int(argv[0]), int(argv[1]), argv[4], argv[5]
    mode, max_steps, saved, out = argv[6], int(argv[7]), argv[8], argv[9]
    torch.set_num_threads(1)
    case = CASES[name]
    train_x, train_y = torch.load(saved)
    model = build_model(case, mode)
    mine = list(range(rank, case.train // case.batch, world))[: max_steps or None]
    with Worker(address, model, cache_rows=case.cache_rows, name=f"bench-{rank}") as worker:
        started, cpu_started = time.perf_counter(), time.process_time()
        for b in mine:
            part = slice(b * case.batch, (b + 1) * case.batch)
            F.cross_entropy(model(train_x[part]), train_y[part]).backward()
            worker.step(samples=case.batch)
        worker.flush()
        figures = worker_figures(worker, rank, len(mine), case.batch, started, cpu_started)
    write_result(out, {**figures, "peak_rss_mb": peak_rss_mb()})


def ddp_main(argv: list[str]) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from paramserver.bench.ddp import finish, write_result

    rank, world, port = (int(a) for a in argv[:3])
    case, out = CASES[argv[3]], argv[4]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=5),
    )
    train_x, train_y, test_x, test_y = data(case)
    torch.manual_seed(0)
    model = models.DLRM(case.fields, case.rows, case.dim, sparse=True, shared=True)
    ddp = DistributedDataParallel(model)
    opts = optimizers(ddp.module, case)
    usable = case.train // case.batch // world * world
    dist.barrier()
    started = time.perf_counter()
    for b in range(rank, usable, world):
        part = slice(b * case.batch, (b + 1) * case.batch)
        F.cross_entropy(ddp(train_x[part]), train_y[part]).backward()  # all-reduce
        for opt in opts:
            opt.step()
            opt.zero_grad()
    dist.barrier()
    seconds = time.perf_counter() - started
    result = {"samples": usable // world * case.batch, "seconds": seconds}
    if rank == 0:
        result["auc"] = auc(model, test_x, test_y)
    write_result(out, result)
    finish()


if __name__ == "__main__":
    if sys.argv[4] == "ps":
        ps_main(sys.argv[1:])
    else:
        ddp_main(sys.argv[1:])
