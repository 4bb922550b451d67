"""A GPT-style character model as a user writes one, for tests of a user's recipe: token
and position embeddings, causal self-attention blocks with LayerNorm and dropout, and an
output head tied to the token embedding (``head.weight is tok.weight``). ``--model
tests.gpt:gpt`` builds it; ``text`` is a seeded character corpus for it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

VOCAB, CONTEXT = 32, 16


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, dim: int = 32, layers: int = 2, heads: int = 2, dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(CONTEXT, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # (B, T, VOCAB) logits


def gpt() -> GPT:
    return GPT()


def text(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences of CONTEXT tokens and their next tokens, drawn with ``seed`` from one
    Markov chain (so there is something to learn, the same whatever the seed): inputs
    (n, T) and targets (n, T), int64."""
    table = torch.randint(0, VOCAB, (VOCAB, 2), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(n, CONTEXT + 1, dtype=torch.int64)
    seq[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(CONTEXT):
        pick = torch.randint(0, 2, (n,), generator=g)
        seq[:, t + 1] = table[seq[:, t], pick]
    return seq[:, :-1], seq[:, 1:]


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of a (B, T, V) output against (B, T) targets."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def dataset() -> tuple[TensorDataset, TensorDataset]:
    """``--dataset tests.gpt:dataset``: 512 training and 128 test sequences of ``text``, as
    (tokens, next tokens) pairs of CONTEXT each: the built-in worker's (B, T) batches."""
    x, y = text(640, seed=2)
    return TensorDataset(x[:512], y[:512]), TensorDataset(x[512:], y[512:])


def smoothed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``--loss tests.gpt:smoothed``: a user's own loss, label-smoothed token cross-entropy
    called as ``loss(outputs, targets)``."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), label_smoothing=0.1
    )


def groups(model: nn.Module, decay: float) -> list[dict]:
    """AdamW's two parameter groups as a user writes them: weight decay on the matrices,
    none on biases, norms and embeddings (the tied head is the token embedding)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = list(model.parameters())
    matrices = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
    rest = [p for p in params if not any(p is m for m in matrices)]
    return [{"params": matrices, "weight_decay": decay}, {"params": rest, "weight_decay": 0.0}]


def warmup_cosine(warmup: int, total: int, floor: float):
    """The schedule's factor of step i as a user writes it for ``LambdaLR``: linear warmup,
    then cosine down to ``floor`` of the rate at ``total``."""

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = min(i - warmup, total - warmup) / (total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
