"""Tables declared, never allocated (sparse/declared.py): on their own they train on an
in-process row store, as torch trains a sparse embedding; nothing is allocated for rows
never touched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from paramserver.sparse import Embedding, EmbeddingBag, Lifecycle
from paramserver.sparse.declared import name_tables
from paramserver.sparse.embedding import table_specs
from paramserver.sparse.rows import initial_rows, table_key

ROWS, DIM = 300, 6


class Model(nn.Module):
    def __init__(self, **table) -> None:
        super().__init__()
        self.bag = EmbeddingBag(ROWS, DIM, mode="sum", optimizer="sgd", lr=0.1, **table)
        self.head = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(ids))


def batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = (torch.rand(n, 8, 3, generator=g) ** 2 * ROWS).long()
    return [(ids[i], ids[i].sum(1) % 2) for i in range(n)]


def test_a_declared_table_trains_on_its_own_as_torch_trains_a_sparse_embedding():
    torch.manual_seed(0)
    model = Model()
    name_tables(model)  # keyed by its path, as in a cluster
    twin = nn.Sequential()
    twin.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    twin.head = nn.Linear(DIM, 2)
    twin.head.load_state_dict(model.head.state_dict())
    with torch.no_grad():
        twin.bag.weight.copy_(
            torch.from_numpy(initial_rows(table_key(0, "bag"), np.arange(ROWS), DIM))
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the dense part: the user's own
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for x, y in batches():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()  # the rows step in backward
        opt.step()
        twin_opt.zero_grad()
        F.cross_entropy(twin.head(twin.bag(x)), y).backward()
        twin_opt.step()
    ids = np.arange(ROWS)
    torch.testing.assert_close(model.bag.local.pull(ids), twin.bag.weight.detach())
    torch.testing.assert_close(model.head.weight, twin.head.weight)
    touched = len(torch.cat([x.flatten() for x, _ in batches()]).unique())
    assert model.bag.local.held == touched  # rows exist only where pushed
    assert [n for n, _ in model.named_parameters()] == ["head.weight", "head.bias"]


def test_a_table_larger_than_memory_allocates_nothing_for_its_rows():
    table = Embedding(10**12, 64)  # 256 TB declared
    out = table(torch.tensor([[0, 10**12 - 1], [5, 5]]))
    out.sum().backward()
    assert out.shape == (2, 2, 64) and table.local.held == 3
    assert table.local.nbytes() < 2 << 20
    forever = Embedding(None, 4, init="uniform:0.1")  # unbounded: any int64
    ids = torch.tensor([-(2**63), -1, 2**62])
    rows = forever(ids)
    assert rows.shape == (3, 4) and rows.abs().max() <= 0.1
    with pytest.raises(ps.InvalidRequest, match="id -1 is outside"):
        Embedding(10, 4)(torch.tensor([-1]))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_a_declared_bag_pools_as_nn_embedding_bag(mode):
    bag = EmbeddingBag(50, 5, mode=mode)
    name_tables(nn.Sequential(bag))
    ref = nn.EmbeddingBag(50, 5, mode=mode)
    with torch.no_grad():
        ref.weight.copy_(bag.local.pull(np.arange(50)))
    ids, offsets = torch.tensor([3, 7, 7, 9, 0, 49]), torch.tensor([0, 2, 5])
    torch.testing.assert_close(bag(ids, offsets), ref(ids, offsets))
    torch.testing.assert_close(bag(ids.view(2, 3)), ref(ids.view(2, 3)))
    if mode == "sum":
        w = torch.rand(6)
        torch.testing.assert_close(bag(ids, offsets, w), ref(ids, offsets, w))


def test_admission_and_capacity_apply_on_its_own_too():
    table = Embedding(100, 3, optimizer="sgd", lr=1.0, lifecycle=Lifecycle(admit_after=2))
    before = table(torch.tensor([4])).detach()
    table(torch.tensor([4])).sum().backward()  # seen once: dropped
    torch.testing.assert_close(table(torch.tensor([4])).detach(), before)
    table(torch.tensor([4])).sum().backward()  # twice: admitted and trained
    torch.testing.assert_close(table(torch.tensor([4])).detach(), before - 1.0)
    assert table.local.tally.dropped == 1
    small = Embedding(None, 3, lifecycle=Lifecycle(capacity=4))
    for start in range(0, 40, 2):
        small(torch.tensor([start, start + 1])).sum().backward()
    assert small.local.held <= 4 and small.local.tally.evicted >= 36


def test_evaluation_does_not_step_and_a_saved_weight_loads():
    model = Model()
    model.eval()
    x, _ = batches(1)[0]
    model(x).sum().backward()
    assert model.bag.local.held == 0
    model.train()
    with torch.no_grad():
        model(x)
    assert model.bag.local.held == 0
    weight = torch.randn(ROWS, DIM)
    state = {**model.state_dict(), "bag.weight": weight}
    model.load_state_dict(state)
    torch.testing.assert_close(model.bag.local.pull(np.arange(ROWS)), weight)
    with pytest.raises(RuntimeError, match="bag.weight is"):
        model.load_state_dict({**state, "bag.weight": torch.zeros(3, DIM)})


def test_declared_tables_are_specs_named_by_their_path():
    model = nn.Sequential(
        nn.Linear(2, 2), EmbeddingBag(None, 4, init="zeros", optimizer="adam", lr=0.01)
    )
    model.add_module("plain", nn.Embedding(20, 3, sparse=True))
    specs = table_specs(model)
    assert [(s.name, s.rows, s.dim, s.init) for s in specs] == [
        ("1", 0, 4, "zeros"),
        ("plain", 20, 3, "normal"),
    ]
    trained = nn.Sequential(Embedding(10, 2))
    trained[0](torch.tensor([1])).sum().backward()  # trained before its name was known
    with pytest.raises(ValueError, match="name_tables"):
        name_tables(trained)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Embedding(0, 4), "num_embeddings"),
        (lambda: Embedding(10, 0), "embedding_dim"),
        (lambda: Embedding(10, 4, init="gauss"), "initialiser"),
        (lambda: Embedding(10, 4, optimizer="lbfgs"), "one of"),
        (lambda: Embedding(10, 4, lr=-1.0), "positive"),
        (lambda: Embedding(10, 4, dtype=torch.int64), "dtype"),
        (lambda: EmbeddingBag(10, 4, mode="median"), "mode"),
        (lambda: Embedding(10, 4, lifecycle=Lifecycle(capacity=-3)), "capacity"),
    ],
)
def test_a_declaration_that_makes_no_sense_is_refused_at_once(make, message):
    with pytest.raises((ValueError, ps.ConfigError), match=message):
        make()


def test_tables_not_named_yet_start_from_rows_of_their_own():
    a, b = Embedding(None, 4), Embedding(None, 4)
    ids = torch.tensor([1, 2, 3])
    assert not torch.equal(a(ids), b(ids))


def test_ids_that_are_not_integers_are_refused_naming_the_table():
    model = nn.Sequential(Embedding(10, 2))
    name_tables(model)
    with pytest.raises(ValueError, match="Table '0': ids must be integers, not float32"):
        model(torch.tensor([1.7, 2.2]))


def test_a_table_used_twice_in_a_step_takes_one_step_as_in_a_cluster():
    """Two uses (or two micro-batches) before the next read: their gradients summed into
    one optimizer step, as a worker's push is; lazy adam counts one step of the row."""
    table = Embedding(10, 3, optimizer="adam", lr=0.1)
    (table(torch.tensor([4])).sum() + 2 * table(torch.tensor([4, 5])).sum()).backward()
    steps = table.local.state[2]
    slots = table.local.index.find(np.array([4, 5]))
    assert steps[torch.from_numpy(slots)].flatten().tolist() == [1, 1]
    once = Embedding(10, 3, optimizer="adam", lr=0.1)
    once.table_name = table.table_name  # the same initial rows
    (
        once(torch.tensor([4, 4, 4, 5]))[[0, 1, 2, 3]] * torch.tensor([[1.0], [2.0], [0.0], [2.0]])
    ).sum().backward()
    ids = np.array([4, 5])
    torch.testing.assert_close(table.local.pull(ids), once.local.pull(ids))


def test_a_state_dict_holds_the_rows_trained_on_its_own():
    model = Model(lifecycle=Lifecycle(capacity=50))
    name_tables(model)
    for x, y in batches():
        F.cross_entropy(model(x), y).backward()
    saved = model.state_dict()
    assert set(saved) == {"bag.rows", "head.weight", "head.bias"}
    back = Model(lifecycle=Lifecycle(capacity=50))
    name_tables(back)
    back.load_state_dict(saved)
    ids = np.arange(ROWS)
    torch.testing.assert_close(back.bag.local.pull(ids), model.bag.local.pull(ids))
    assert back.bag.local.tally.state() == model.bag.local.tally.state()
    assert "bag.rows" not in Model().state_dict()  # nothing trained: no key
