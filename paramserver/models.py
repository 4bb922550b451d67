"""Model factories, by name or by ``module:function``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paramserver.codec.layout import Manifest
from paramserver.errors import ConfigError
from paramserver.sparse.table import TableSpec


def mlp() -> nn.Module:
    """784-256-128-10 multilayer perceptron for 28x28 images."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


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

    def __init__(self, fields: int, rows: int, dim: int = 16, hidden: int = 64,
                 sparse: bool = False, shared: bool = False):  # fmt: skip
        super().__init__()
        self.fields, self.rows, self.shared = fields, rows, shared
        self.tables = nn.ModuleList(nn.Embedding(rows * (fields if shared else 1), dim,
                                                 sparse=sparse)
                                    for _ in range(1 if shared else fields))  # fmt: skip
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
    from paramserver import clicks

    return DLRM(clicks.FIELDS, clicks.ROWS)


def dlrm_sparse() -> nn.Module:
    """``dlrm`` with its tables as sparse tables: the servers hold their rows."""
    from paramserver import clicks

    return DLRM(clicks.FIELDS, clicks.ROWS, sparse=True)


FACTORIES: dict[str, Callable[[], nn.Module]] = {
    "mlp": mlp, "cnn": cnn, "resnet": resnet, "dlrm": dlrm, "dlrm-sparse": dlrm_sparse,
}  # fmt: skip


def resolve(spec: str) -> Callable[[], nn.Module]:
    """The factory for ``spec``: a built-in name or ``module:function``.

    Raises:
        ConfigError: the name is unknown or the function cannot be imported.
    """
    if spec in FACTORIES:
        return FACTORIES[spec]
    if ":" not in spec:
        raise ConfigError(
            f"Unknown model {spec!r}: use one of {', '.join(FACTORIES)} or 'module:function'."
        )
    return import_function(spec, "model")


def import_function(spec: str, what: str) -> Callable[[], Any]:
    """The function ``module:function`` names, for a ``what`` (model, dataset).

    Raises:
        ConfigError: the module cannot be imported or has no such function.
    """
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure to import gets the same sentence
        raise ConfigError(
            f"Cannot import module {module_name!r} for {what} {spec!r}: {exc}."
        ) from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(
            f"Module {module_name!r} has no function {func_name!r} ({what} {spec!r})."
        )
    return func


def build(spec: str, seed: int | None = None) -> nn.Module:
    """Build the model named by ``spec``; with ``seed``, its initial weights are reproducible."""
    factory = resolve(spec)
    if seed is not None:
        torch.manual_seed(seed)
    model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"Model factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module."
        )
    return model


def parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainable parameters, in the order that defines the flat buffer. Frozen ones
    (``requires_grad=False``) are left out: never pushed, never updated, no bytes on the wire.
    So are the weights of sparse embeddings (``sparse=True``): the servers hold them as
    tables, row by row (``table_specs``).

    Raises:
        ConfigError: a parameter is not floating-point, or a sparse embedding a table cannot
            stand in for.
    """
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise ConfigError(
                f"Parameter {name!r} has dtype {str(p.dtype).removeprefix('torch.')}: "
                "paramserver carries floating-point parameters only. Register it as a buffer "
                "(module.register_buffer) instead."
            )
    tables = {f"{t.name}.weight".lstrip(".") for t in table_specs(model)}
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and n not in tables]


def table_specs(model: nn.Module) -> list[TableSpec]:
    """The tables of ``model``: one per trainable sparse embedding, named by its module path.

    Raises:
        ConfigError: an embedding a table cannot stand in for (the message names it).
    """
    from paramserver.sparse.embedding import table_specs as specs

    try:
        return specs(model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def buffers(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """The buffers that are part of the run's state, with their roles: the persistent ones
    (those ``state_dict`` holds), floating-point first ("buffer": the server keeps the mean
    over workers), then integer ones ("count": the server keeps the largest value)."""
    persistent = set(model.state_dict(keep_vars=True))
    named = [(n, b) for n, b in model.named_buffers() if n in persistent]
    floats = [(n, b, "buffer") for n, b in named if b.is_floating_point()]
    return floats + [(n, b, "count") for n, b in named if not b.is_floating_point()]


def state(model: nn.Module) -> tuple[Manifest, list[torch.Tensor]]:
    """The layout of ``model``'s run state (trainable parameters, then buffers) as the flat
    buffer, and its tensors in that order.

    Raises:
        ConfigError: a parameter or buffer paramserver cannot carry (the message names it).
    """
    named = [(n, p, "param") for n, p in parameters(model)] + buffers(model)
    manifest = Manifest.from_tensors([(n, t) for n, t, _ in named], [r for _, _, r in named])
    return manifest, [t for _, t, _ in named]
