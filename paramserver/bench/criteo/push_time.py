"""A server's table work per push on the Criteo case, without the wire or the workers (issue
44's "a Criteo push's server time"): the pushes of one (h) worker (the case's 26 tables x
16, the case's row optimizer, its batch of the Criteo-like stream, each batch's ids made distinct as the
worker makes them) replayed against one shard's ``TableSet``: a row pull's lookup and its
initial values, ``check`` (outside the coordinator's lock) and ``apply`` (under it), ms a
push each, past the first ``WARM`` pushes (which create most rows).
``docs/measure_criteo_push.py`` adds the hashed index and one table beside it.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from paramserver.bench.criteo.model import LR, ROWS
from paramserver.bench.criteo.stream import DENSE, make
from paramserver.codec.rows import RowGradients, TableSpec
from paramserver.sparse.optim import RowOptimizerConfig
from paramserver.sparse.table import complete_all
from paramserver.sparse.tableset import TableSet

DIM, WARM = 16, 20
Push = list[tuple[str, np.ndarray]]


def pushes(cards: tuple[int, ...], batch: int, steps: int) -> list[Push]:
    """Each step's distinct ids of every table (``t0``..``t25``) of the stream at ``cards``."""
    x, _, _, _ = make(batch * steps, 1, cards=cards)
    ids = x[:, DENSE:].numpy() % np.array(cards)
    return [
        [(f"t{f}", np.unique(ids[s * batch : (s + 1) * batch, f])) for f in range(len(cards))]
        for s in range(steps)
    ]


def replay(specs: list[TableSpec], pushed: list[Push]) -> dict[str, float]:
    """ms a push of each part (pull, check, apply) and in all, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tables = TableSet(specs, RowOptimizerConfig(ROWS, LR))  # the case's
        took = {"pull": 0.0, "check": 0.0, "apply": 0.0}
        g = torch.Generator().manual_seed(0)
        for n, push in enumerate(pushed):
            t0 = time.perf_counter()
            complete_all(tables.lookup_many(push))
            t1 = time.perf_counter()
            grads = [
                RowGradients(t, ids, torch.randn(len(ids), DIM, generator=g)) for t, ids in push
            ]
            t2 = time.perf_counter()
            checked = tables.check(grads)
            t3 = time.perf_counter()
            tables.apply(checked, 0.01, n + 1)
            t4 = time.perf_counter()
            if n >= WARM:
                took["pull"] += t1 - t0
                took["check"] += t3 - t2
                took["apply"] += t4 - t3
    finally:
        torch.set_num_threads(threads)
    out = {k: 1e3 * v / max(len(pushed) - WARM, 1) for k, v in took.items()}
    out["total"] = sum(out.values())
    return out


def measure(cards: tuple[int, ...], batch: int, steps: int = 120) -> dict[str, float]:
    """The case's push: ms a push (pull, check, apply, total) and its distinct rows."""
    pushed = pushes(cards, batch, steps)
    specs = [TableSpec(f"t{f}", c, DIM) for f, c in enumerate(cards)]
    out = replay(specs, pushed)
    out["rows"] = sum(len(ids) for push in pushed for _, ids in push) / len(pushed)
    return out
