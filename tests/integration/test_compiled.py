"""``torch.compile`` and a worker (issue 56, must 8): a model compiled after the join, or
compiled first and passed to ``ps.Worker``, trains as the eager model does, with a sparse
table and without. The compiled graphs go through dynamo and AOT autograd (``aot_eager``:
no C++ compiler needed); the tables' row work stays eager (``RowLookup._rows``). Before,
dynamo failed inside the row index, and a compiled module was refused at the join."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps

STEPS = 4


class Clicks(nn.Module):
    def __init__(self, table: bool):
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(50, 8, mode="sum", sparse=table)
        self.lin = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.bag(x)))


def _train(serve, table: bool, how: str) -> dict[str, torch.Tensor]:
    server = serve(Clicks(table), policy="sync", workers=1, optimizer="sgd", lr=0.1)
    model = Clicks(table)
    given: nn.Module = torch.compile(model, backend="aot_eager") if how == "before" else model
    g = torch.Generator().manual_seed(1)
    with ps.Worker(server.address, given, overlap=False) as worker:
        run = torch.compile(model, backend="aot_eager") if how == "after" else given
        for _ in range(STEPS):
            x = torch.randint(0, 50, (16, 3), generator=g)
            F.cross_entropy(run(x), x[:, 0] % 2).backward()
            worker.step(samples=len(x))
    return server.model_state_dict()


@pytest.mark.parametrize("table", [True, False], ids=["table", "dense"])
def test_a_compiled_model_trains_as_the_eager_one(serve, table):
    eager = _train(serve, table, "eager")
    for how in ("after", "before"):  # compiled after the join; compiled, then passed in
        got = _train(serve, table, how)
        assert got.keys() == eager.keys()
        for name, value in eager.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"{how}: {name}")
