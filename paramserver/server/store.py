"""The global model: one flat buffer (parameters, then buffers; float32, or float64 for a
float64 model), its version and the server-side optimizer over the parameters' section."""

from __future__ import annotations

import numpy as np
import torch

from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig


def build_optimizer(params: list[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The torch optimizer named by ``cfg`` over ``params``."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.name == "momentum":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    adam = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
    try:
        # The fused kernel: one pass over the flat buffer. Measured on the MLP's 235k
        # parameters, one thread: 0.27 ms a step against 0.6-2.3 ms for the default.
        return adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    except (RuntimeError, TypeError, ValueError):  # a torch or device without it
        return adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


class ParameterStore:
    """Flat parameters, updated in place by a torch optimizer, and the buffers after them.

    The optimizer sees the parameters' section as one flat tensor; elementwise optimizers
    (SGD, momentum, Adam, AdamW) give exactly the per-tensor result. The buffers' section
    (``manifest.section``: "buffer" and "count") is set by ``set_buffers``. Not
    thread-safe: the coordinator serialises calls.
    """

    def __init__(self, manifest: Manifest, initial: np.ndarray, optimizer: OptimizerConfig):
        if initial.dtype != manifest.np_dtype or initial.size != manifest.numel:
            raise ValueError(
                f"Initial weights must be {manifest.numel} {manifest.dtype} values; got "
                f"{initial.size} {initial.dtype}."
            )
        self.manifest = manifest
        self.config = optimizer
        self.flat = torch.from_numpy(initial.copy())
        self.n_params = manifest.section("param")[1]
        # A view: the optimizer's steps land in the flat buffer that pulls read.
        self.param = torch.nn.Parameter(self.flat[: self.n_params])
        self.optimizer = build_optimizer([self.param], optimizer)
        self.version = 0
        self._snapshot: np.ndarray | None = None

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return self.config.lr_at(self.version)

    @property
    def weights(self) -> np.ndarray:
        """A live numpy view of the weights and buffers (changes with every step)."""
        return self.flat.numpy()

    def apply(self, grad: np.ndarray) -> None:
        """One optimizer step with ``grad``, the gradient of the parameters' section."""
        self.param.grad = torch.from_numpy(grad)
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr_at(self.version)
        self.optimizer.step()
        self.param.grad = None
        self.version += 1
        self._snapshot = None

    def restore(self, weights: np.ndarray, optimizer_state: dict, version: int) -> None:
        """Take over the weights, optimizer state and version of a checkpoint."""
        if weights.size != self.manifest.numel:
            raise ValueError(f"{weights.size} weights for a model of {self.manifest.numel}.")
        with torch.no_grad():
            self.flat.copy_(torch.from_numpy(np.ascontiguousarray(weights, self.manifest.np_dtype)))
        self.optimizer.load_state_dict(optimizer_state)
        self.version = version
        self._snapshot = None

    def set_buffers(self, values: np.ndarray) -> None:
        """Set the buffers' section (everything after the parameters) to ``values``."""
        self.flat[self.n_params :] = torch.from_numpy(values)
        self._snapshot = None

    def snapshot(self) -> np.ndarray:
        """An immutable copy of the current weights, shared by every pull of this version."""
        if self._snapshot is None:
            snap = self.weights.copy()
            snap.setflags(write=False)
            self._snapshot = snap
        return self._snapshot
