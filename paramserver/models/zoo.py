"""The built-in models: ``mlp`` and ``cnn`` (Fashion-MNIST), ``resnet``, ``mlp-20m`` (a
wide MLP whose bytes dominate its compute), ``dlrm`` / ``dlrm-sparse`` (the click log) and
``gpt-tiny`` (a byte-level language model: ``models/gpt.py``), each a function that builds a
fresh module."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from paramserver.models.gpt import gpt_tiny

# The built-in click log's shape (``training/clicks.py``), which ``dlrm`` is sized for.
CLICK_FIELDS = 8
CLICK_ROWS = 10_000  # ids per field


def _perceptron(*widths: int) -> nn.Module:
    """A multilayer perceptron for 28x28 images: 784, then ``widths`` (ReLU between)."""
    layers: list[nn.Module] = [nn.Flatten()]
    sizes = (784, *widths)
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers += [nn.Linear(a, b)] if i == len(widths) - 1 else [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


def mlp() -> nn.Module:
    """784-256-128-10 multilayer perceptron for 28x28 images."""
    return _perceptron(256, 128, 10)


def mlp_20m() -> nn.Module:
    """784-4096-4096-10 multilayer perceptron for 28x28 images: 20.0M parameters (80 MB of
    float32), so moving its bytes costs more than computing a batch (``bench step`` on a
    GPU)."""
    return _perceptron(4096, 4096, 10)


def cnn() -> nn.Module:
    """A small two-convolution network for 28x28 images."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a shortcut (a 1x1 convolution when the shape
    changes), as in He et al., "Deep Residual Learning for Image Recognition" (2015)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet() -> nn.Module:
    """A small ResNet for 1x28x28 images: a 3x3 stem, three basic blocks of 16, 32 and 64
    channels at 28, 14 and 7 pixels, global average pooling and a linear layer (78k
    parameters, 13 BatchNorm layers)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, 1, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        BasicBlock(16, 16),
        BasicBlock(16, 32, stride=2),
        BasicBlock(32, 64, stride=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


class DLRM(nn.Module):
    """A DLRM-style click model (Naumov et al., 2019) for ``--dataset clicks``: one embedding
    table per categorical field, the dot products of every pair of fields' embeddings,
    and an MLP over the embeddings and the dot products that answers two logits.

    The tables keep ``nn.Embedding``'s N(0, 1) initialisation; their rows are scaled by
    1/sqrt(dim) in the forward pass so that the dot products start near unit variance.
    ``shared``: one table of ``fields * rows`` rows, field f's ids at ``f * rows`` on (one
    large table, as ``bench sparse`` measures).
    """

    def __init__(
        self,
        fields: int,
        rows: int,
        dim: int = 16,
        hidden: int = 64,
        sparse: bool = False,
        shared: bool = False,
    ):
        super().__init__()
        self.fields, self.rows, self.shared = fields, rows, shared
        self.tables = nn.ModuleList(
            nn.Embedding(rows * (fields if shared else 1), dim, sparse=sparse)
            for _ in range(1 if shared else fields)
        )
        self.scale = dim**-0.5
        pairs = fields * (fields - 1) // 2
        self.register_buffer("_left", torch.triu_indices(fields, fields, 1)[0], persistent=False)
        self.register_buffer("_right", torch.triu_indices(fields, fields, 1)[1], persistent=False)
        self.top = nn.Sequential(
            nn.Linear(fields * dim + pairs, hidden), nn.ReLU(), nn.Linear(hidden, 2)
        )

    def table_ids(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The ids each table looks up for input ``x``: the worker daemon prefetches a batch's
        rows with them (any model may define this)."""
        if self.shared:
            return {"tables.0": self._offset(x).flatten()}
        return {f"tables.{f}": x[:, f] for f in range(len(self.tables))}

    def _offset(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(self.fields, device=x.device) * self.rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared:
            e = self.tables[0](self._offset(x)) * self.scale
        else:
            e = torch.stack([t(x[:, f]) for f, t in enumerate(self.tables)], dim=1) * self.scale
        dots = torch.bmm(e, e.transpose(1, 2))[:, self._left, self._right]  # type: ignore[index]
        return self.top(torch.cat([e.flatten(1), dots], dim=1))  # type: ignore[no-any-return]


def dlrm() -> nn.Module:
    """``DLRM`` sized for the built-in ``clicks`` log: 8 tables of 10,000 rows x 16."""
    return DLRM(CLICK_FIELDS, CLICK_ROWS)


def dlrm_sparse() -> nn.Module:
    """``dlrm`` with its tables as sparse tables: the servers hold their rows."""
    return DLRM(CLICK_FIELDS, CLICK_ROWS, sparse=True)


FACTORIES: dict[str, Callable[[], nn.Module]] = {
    "mlp": mlp,
    "cnn": cnn,
    "resnet": resnet,
    "dlrm": dlrm,
    "dlrm-sparse": dlrm_sparse,
    "mlp-20m": mlp_20m,
    "gpt-tiny": gpt_tiny,
}
