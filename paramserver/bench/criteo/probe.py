"""Where the Criteo case's AUC goes (issue 44): one configuration of its DLRM at a chosen
size, trained one way, and its test AUC. Not part of ``bench sparse`` (whose runs and keys
stay ``case.py``'s); ``docs/measure_criteo_auc.py`` runs the set of them.

A ``Probe`` is the Criteo-like stream at the cardinalities / ``divisor``, ``train``
samples (one epoch, batches in order), ``test`` test samples, batch ``batch``, the dense
part under Adam at ``lr`` and the 26 declared tables under ``rows`` (a row optimizer) at
``rows_lr``, the dense part initialised from ``seed``. Two ways to train it:

- ``local(probe, stale=...)``: one process, every batch in order, as ``ranks.local_run``;
  ``stale`` "dense", "rows" or "both" makes each batch's gradient of that part be computed
  on the weights without the previous batch's update (a staleness of exactly one step for
  every batch, as two async workers in lockstep would have; the other part fresh), each
  update still applied once, in order; "dense:PREFIX" only the dense parameters whose
  names start with PREFIX ("dense:top.", "dense:bottom."); a suffix "@N": from batch N on
  (the first N fresh); "dense-sync": two workers' dense part synchronous, rows async
  (``_dense_sync``). "" is the plain local process.
- ``cluster(probe, policy, world, logs)``: a server in this process (``policy``,
  ``world`` workers) and ``world`` worker processes (``python -m
  paramserver.bench.criteo.probe``), rank r training batches r, r + world, ... of the epoch
  as ``ranks.ps_main`` does; the AUC of the server's model once they are done.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
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
from paramserver.bench.criteo.model import DIM, LR, CriteoDLRM
from paramserver.bench.criteo.ranks import auc
from paramserver.bench.ddp import peak_rss_mb, run_ranks, worker_figures, write_result
from paramserver.sparse import name_tables
from paramserver.sparse.declared import Embedding, coalesce, declared

MODULE = "paramserver.bench.criteo.probe"
STALE = ("", "dense", "rows", "both")


@dataclass(frozen=True)
class Probe:
    divisor: int = 10
    train: int = 300_000
    test: int = 100_000
    batch: int = 1024
    lr: float = LR  # the dense part's Adam
    beta1: float = 0.9  # its first moment's decay (torch's default)
    dc: float = 0.0  # --delay-compensation of a stale dense gradient (0: none)
    rows: str = "adam"  # the tables' row optimizer (the case's: lazy Adam)
    rows_lr: float = LR
    seed: int = 0  # of the dense part's initial weights (the rows' are the tables' own)

    @property
    def cards(self) -> tuple[int, ...]:
        return criteo.scaled(self.divisor) if self.divisor > 1 else criteo.CARDINALITIES

    def batches(self, rank: int = 0, world: int = 1) -> list[slice]:
        b = self.batch
        return [slice(i * b, (i + 1) * b) for i in range(rank, self.train // b, world)]


@cache
def data(divisor: int, train: int, test: int) -> tuple[torch.Tensor, ...]:
    cards = Probe(divisor).cards
    return criteo.make(train, test, seed=0, cards=cards)


def model(p: Probe, mode: str = "declared") -> CriteoDLRM:
    """The case's DLRM (``model.build``'s, the same seed), its declared tables under
    ``p.rows``; ``mode`` "dense": plain ``nn.Embedding`` tables, storage left empty, for
    the server's state dict to be assigned to."""
    torch.manual_seed(p.seed)
    rows = list(p.cards)

    def table(r: int) -> nn.Module:
        if mode == "declared":
            return Embedding(r, DIM, optimizer=p.rows, lr=p.rows_lr)
        return nn.Embedding(r, DIM, _weight=torch.empty(r, DIM))

    return CriteoDLRM([table(r) for r in rows], rows, DIM)


def local(p: Probe, stale: str = "") -> dict[str, Any]:
    """One process over the epoch, the ``stale`` part of each gradient one step old (see
    the module), from batch ``AFTER`` on if ``stale`` ends in "@AFTER" (the batches before
    it fresh): samples/s and test AUC."""
    if stale == "dense-sync":
        return _dense_sync(p)
    stale, _, after = stale.partition("@")
    fresh_until = int(after or 0)
    prefix = stale.partition(":")[2] if stale.startswith("dense:") else ""
    if stale not in STALE and not prefix:
        raise ValueError(f"stale is one of {STALE} or dense:PREFIX; got {stale!r}.")
    torch.set_num_threads(1)
    train_x, train_y, test_x, test_y = data(p.divisor, p.train, p.test)
    net = model(p)
    name_tables(net)  # the rows a cluster starts from
    tables = [t for _, t in declared(net)]
    named = list(net.named_parameters())  # the dense part: declared tables hold none
    params = [q for _, q in named]
    opt = torch.optim.Adam(params, lr=p.lr, betas=(p.beta1, 0.999))
    late = [stale in ("dense", "both") or bool(prefix) and n.startswith(prefix) for n, _ in named]
    late_dense, late_rows = any(late), stale in ("rows", "both")
    if prefix and not late_dense:
        raise ValueError(f"No dense parameter's name starts with {prefix!r}.")

    def dense_step(grads: list[torch.Tensor], which: bool) -> None:
        """Adam on the parameters whose ``late`` is ``which`` (the others' grads None:
        skipped; each parameter's state is its own)."""
        for q, g, is_late in zip(params, grads, late, strict=True):
            q.grad = g if is_late == which else None
        if which and p.dc and read is not None:  # g + dc/lr g*g*(w now - w read) / sqrt(v)
            for q, w in zip(params, read, strict=True):
                v = opt.state.get(q, {}).get("exp_avg_sq")
                if q.grad is not None and v is not None:  # bias-corrected, as Adam reads it
                    v = v / (1 - 0.999 ** float(opt.state[q]["step"]))
                    g = q.grad
                    q.grad = g + p.dc / p.lr * g * g * (q.detach() - w) / (v.sqrt() + 1e-8)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def rows_step(pending: list[list[Any]]) -> None:
        for t, parts in zip(tables, pending, strict=True):
            if parts:
                t.local.push(*coalesce(parts))

    held: tuple[list[torch.Tensor], list[list[Any]]] | None = None  # the late updates
    read: list[torch.Tensor] | None = None  # the weights the held gradient was computed on
    started = time.perf_counter()
    for i, part in enumerate(p.batches()):
        now_read = [q.detach().clone() for q in params] if p.dc else None
        F.cross_entropy(net(train_x[part]), train_y[part]).backward()
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
        opt.zero_grad(set_to_none=True)
        pending = [t._pending for t in tables]  # this batch's row gradients, taken
        for t in tables:
            t._pending = []
        if held is not None:  # the previous batch's late part lands after this one read
            if late_dense:
                dense_step(held[0], True)
            if late_rows:
                rows_step(held[1])
        if i < fresh_until:  # every part of this batch's update now
            dense_step(grads, True)
            dense_step(grads, False)
            rows_step(pending)
            continue
        dense_step(grads, False)  # the fresh parameters' (none: a step of nothing)
        if not late_rows:
            rows_step(pending)
        held, read = (grads, pending), now_read
    if held is not None:
        if late_dense:
            dense_step(held[0], True)
        if late_rows:
            rows_step(held[1])
    seconds = time.perf_counter() - started
    samples = len(p.batches()) * p.batch
    return {"samples": samples, "seconds": seconds, "auc": auc(net, test_x, test_y)}


def _dense_sync(p: Probe) -> dict[str, Any]:
    """Two workers with the dense part synchronous and the rows asynchronous (Persia's
    split), in one process: each pair of batches computed on the same weights, the dense
    gradients averaged into one Adam step, each batch's rows applied as their own step,
    one after the other (the second batch's rows read without the first's update)."""
    torch.set_num_threads(1)
    train_x, train_y, test_x, test_y = data(p.divisor, p.train, p.test)
    net = model(p)
    name_tables(net)
    tables = [t for _, t in declared(net)]
    params = list(net.parameters())
    opt = torch.optim.Adam(params, lr=p.lr, betas=(p.beta1, 0.999))
    parts = p.batches()
    started = time.perf_counter()
    for i in range(0, len(parts), 2):
        taken = []
        for part in parts[i : i + 2]:
            loss = F.cross_entropy(net(train_x[part]), train_y[part])
            (loss / len(parts[i : i + 2])).backward()  # the dense gradients: the mean
            taken.append([t._pending for t in tables])
            for t in tables:
                t._pending = []
        opt.step()
        opt.zero_grad(set_to_none=True)
        for pending in taken:  # the rows' steps, as each push arrives
            for t, got in zip(tables, pending, strict=True):
                if got:
                    ids, grads = coalesce(got)
                    t.local.push(ids, grads * len(taken))  # each its own batch's mean
    seconds = time.perf_counter() - started
    samples = len(parts) * p.batch
    return {"samples": samples, "seconds": seconds, "auc": auc(net, test_x, test_y)}


def cluster(p: Probe, policy: str, world: int, logs: Path) -> dict[str, Any]:
    """A server in this process (``policy``, Adam at ``p.lr`` on the dense part, the
    declared row optimizer on the tables) and ``world`` worker processes over one epoch:
    samples/s, wall seconds, the workers' largest staleness seen, and the test AUC of the
    server's model after the epoch."""
    from paramserver.api import serve

    logging.getLogger("paramserver").setLevel(logging.WARNING)
    logs.mkdir(parents=True, exist_ok=True)
    saved = logs / f"probe-train-{p.divisor}-{p.train}.pt"
    if not saved.exists():
        torch.save(data(p.divisor, p.train, p.test)[:2], saved)
    started = time.perf_counter()
    server = serve(
        model(p),
        optimizer="adam",
        lr=p.lr,
        policy=policy,
        workers=world,
        lease_seconds=300,
        delay_compensation=p.dc,
    )
    try:
        results = run_ranks(
            MODULE,
            [json.dumps(dataclasses.asdict(p)), server.address, str(saved)],
            world,
            logs,
            f"probe-{policy}-{world}",
            timeout=3600,
        )
        wall = time.perf_counter() - started
        state = server.model_state_dict()
    finally:
        server.stop(grace=0)
    del server
    gc.collect()
    net = model(p, "dense")
    net.load_state_dict(state, strict=True, assign=True)
    del state
    _, _, test_x, test_y = data(p.divisor, p.train, p.test)
    return {
        "samples": sum(r["samples"] for r in results),
        "samples_per_s": sum(r["samples"] for r in results) / max(r["seconds"] for r in results),
        "seconds": wall,
        "staleness": max(r["staleness"] for r in results),
        "auc": auc(net, test_x, test_y),
    }


def worker_main(argv: list[str]) -> None:
    """``RANK WORLD PORT PROBE ADDRESS DATA OUT`` (PORT unused; PROBE a ``Probe`` as JSON)."""
    from paramserver.worker.worker import Worker

    rank, world = int(argv[0]), int(argv[1])
    p = Probe(**json.loads(argv[3]))
    address, saved, out = argv[4], argv[5], argv[6]
    torch.set_num_threads(1)
    train_x, train_y = torch.load(saved)
    net = model(p)
    mine = p.batches(rank, world)
    most = 0
    with Worker(address, net, name=f"probe-{rank}") as worker:
        started, cpu_started = time.perf_counter(), time.process_time()
        for part in mine:
            worker.prefetch(net.table_ids(train_x[part]))
            F.cross_entropy(net(train_x[part]), train_y[part]).backward()
            worker.step(samples=p.batch)
            most = max(most, worker.last_staleness)
        worker.flush()
        figures = worker_figures(worker, rank, len(mine), p.batch, started, cpu_started)
    write_result(out, {**figures, "staleness": most, "peak_rss_mb": peak_rss_mb()})


if __name__ == "__main__":
    worker_main(sys.argv[1:])
