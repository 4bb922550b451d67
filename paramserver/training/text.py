"""``text``: a byte-level language-modelling set that every machine with Python has, no
download: the source of this Python's standard library (its top-level ``*.py`` modules, in
name order, whole files until at least ``CORPUS_BYTES``). Bytes are the tokens (a vocabulary
of 256, no tokenizer to fetch); a sample is ``CONTEXT`` bytes and the same window one byte
on (the next token at each position), cut without overlap. The last tenth is the test set.

Another Python version has other sources, so a cluster's workers must run the same Python:
the server refuses a worker whose training set has another size (``BatchQueue.plan``), which
whole files make all but certain when the text differs.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from paramserver.models.gpt import CONTEXT  # bytes a sample; the tokens: 256 bytes

CORPUS_BYTES = 1 << 20  # at least this much text: 14,935 training samples of 64 (3.11.7)
TEST_SHARE = 0.1


def stdlib_dir() -> Path:
    return Path(os.__file__).resolve().parent


def corpus(least: int = CORPUS_BYTES, folder: Path | None = None) -> bytes:
    """Whole ``*.py`` files of ``folder`` (the standard library's), in name order, until
    at least ``least`` bytes."""
    parts, size = [], 0
    for path in sorted((folder or stdlib_dir()).glob("*.py")):
        part = path.read_bytes()
        parts.append(part)
        size += len(part)
        if size >= least:
            break
    return b"".join(parts)


def sequences(raw: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (N, CONTEXT) and next-byte targets (N, CONTEXT), int64, from ``raw``."""
    tokens = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))
    n = (len(tokens) - 1) // CONTEXT
    x = tokens[: n * CONTEXT].view(n, CONTEXT)
    y = tokens[1 : n * CONTEXT + 1].view(n, CONTEXT)
    return x, y


def split(raw: bytes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_x, train_y, test_x, test_y): the windows in order, the last tenth for test."""
    x, y = sequences(raw)
    cut = len(x) - max(1, int(len(x) * TEST_SHARE))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def train_size() -> int:
    """Training samples of this machine's ``text`` set."""
    return len(split(corpus())[0])
