"""Atomic checkpoints that load with plain ``torch.load``.

Keys of a checkpoint file:
    format            "paramserver-checkpoint-v1"
    model_state_dict  {parameter name: tensor}: ``model.load_state_dict(ckpt["model_state_dict"])``
    version           optimizer steps applied
    policy, model     the run's policy and model factory
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paramserver import codec

FORMAT = "paramserver-checkpoint-v1"


def save(path: str | Path, manifest: codec.Manifest, flat: np.ndarray, **meta: Any) -> Path:
    """Write a checkpoint atomically: temporary file, fsync, rename, fsync of the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "model_state_dict": codec.state_dict(manifest, flat), **meta}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint (tensors and plain values only: no code is unpickled)."""
    return torch.load(path, weights_only=True)
