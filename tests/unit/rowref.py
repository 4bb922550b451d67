"""Row optimizers written from their definitions, one row at a time, for tests to hold the
vectorised ones (``paramserver/sparse/optim.py``) against."""

from __future__ import annotations

import math

import torch


class Reference:
    """A whole table's values and state, stepped row by row."""

    def __init__(self, values: torch.Tensor, name: str, lr: float, eps: float = 1e-8):
        self.values = values.clone().double()
        self.name, self.lr, self.eps = name, lr, eps
        rows, dim = values.shape
        self.sum = torch.zeros(rows, dtype=torch.float64)  # rowwise-adagrad: G per row
        self.m = torch.zeros(rows, dim, dtype=torch.float64)
        self.v = torch.zeros(rows, dim, dtype=torch.float64)
        self.t = [0] * rows  # lazy adam: each row's own steps

    def step(self, ids: list[int], grads: torch.Tensor) -> None:
        for row, g in zip(ids, grads.double(), strict=True):
            if self.name == "rowwise-adagrad":
                # G[r] += mean(g**2); w[r] -= lr * g / (sqrt(G[r]) + eps)
                self.sum[row] += float((g * g).mean())
                self.values[row] -= self.lr * g / (math.sqrt(self.sum[row]) + self.eps)
            else:  # lazy adam, bias-corrected by the row's own step count
                b1, b2 = 0.9, 0.999
                self.t[row] += 1
                t = self.t[row]
                self.m[row] = b1 * self.m[row] + (1 - b1) * g
                self.v[row] = b2 * self.v[row] + (1 - b2) * g * g
                # torch's SparseAdam form: eps added to sqrt(v), the bias folded in the rate
                rate = self.lr * math.sqrt(1 - b2**t) / (1 - b1**t)
                self.values[row] -= rate * self.m[row] / (self.v[row].sqrt() + self.eps)
