"""``gpt-tiny``: a small byte-level transformer language model (GPT-2's shape, scaled down):
token and position embeddings, pre-norm causal self-attention blocks with dropout, a final
LayerNorm and an output head tied to the token embedding (``head.weight is tok.weight``:
one tensor, trained once). For ``--dataset text`` (``training/text.py``): 256 byte tokens,
a context of 64. Its (B, T, 256) logits against (B, T) next bytes train and evaluate per
token (``training/losses.py``); the evaluation reports perplexity."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, CONTEXT = 256, 64


class Block(nn.Module):
    """LayerNorm, causal multi-head self-attention, LayerNorm, a 4x MLP; both residual."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(
        self,
        dim: int = 128,
        layers: int = 2,
        heads: int = 4,
        dropout: float = 0.1,
        vocab: int = VOCAB,
        context: int = CONTEXT,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # (B, T, vocab) logits


def gpt_tiny() -> nn.Module:
    """128 wide, 2 blocks of 4 heads, context 64, bytes: 0.44M parameters (the head is the
    token embedding)."""
    return GPT()
