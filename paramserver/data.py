"""Data sets (Fashion-MNIST from IDX files, a seeded synthetic one) and the shared sharding."""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from paramserver.errors import DataUnavailable

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
# Fashion-MNIST's training-set pixel mean and standard deviation.
_MEAN, _STD = 0.2860, 0.3530


@dataclass(frozen=True)
class Dataset:
    """Images as float32 (N, 1, 28, 28) and labels as int64 (N,)."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataUnavailable(f"{path} is not an IDX file of unsigned bytes.")
    ndim = raw[3]
    dims = np.frombuffer(raw, ">u4", count=ndim, offset=4).astype(int)
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DataUnavailable(
            f"{path} holds {data.size} bytes of data; its header announces {dims}."
        )
    return data.reshape(dims)


def _find(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx")):
        if (folder / name).exists():
            return folder / name
    return None


def default_data_dir() -> Path:
    """``$PARAMSERVER_DATA_DIR`` if set, else where Debian's dataset-fashion-mnist puts it."""
    return Path(os.environ.get("PARAMSERVER_DATA_DIR") or DEBIAN_DIR)


def load_idx_folder(folder: str | Path | None = None) -> Dataset:
    """Load Fashion-MNIST (or MNIST: same format) from a folder of the four IDX files.

    Raises:
        DataUnavailable: a file is missing or malformed; the message says how to get it.
    """
    root = Path(folder) if folder else default_data_dir()
    paths = {key: _find(root, stem) for key, stem in _FILES.items()}
    missing = [_FILES[k] for k, p in paths.items() if p is None]
    if missing:
        raise DataUnavailable(
            f"Fashion-MNIST not found in {root} (missing {', '.join(missing)}): install "
            "Debian's package with 'apt-get install dataset-fashion-mnist', or pass --data-dir "
            "with a folder of the four IDX files (MNIST works too)."
        )
    arrays = {k: _read_idx(p) for k, p in paths.items() if p is not None}

    def images(a: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(a.astype(np.float32) / 255.0)
        return ((x - _MEAN) / _STD).view(-1, 1, 28, 28)

    return Dataset(
        images(arrays["train_x"]),
        torch.from_numpy(arrays["train_y"].astype(np.int64)),
        images(arrays["test_x"]),
        torch.from_numpy(arrays["test_y"].astype(np.int64)),
    )


SYNTHETIC_TRAIN = 4096


def synthetic(train: int = SYNTHETIC_TRAIN, test: int = 1024, seed: int = 0) -> Dataset:
    """A seeded linear teacher: 16 latent factors projected to 28x28 images, label = argmax(W z).

    Low intrinsic dimension keeps it learnable in a few hundred steps, for fast tests.
    """
    g = torch.Generator().manual_seed(seed)
    latent, projection = 16, torch.randn(16, 784, generator=g) / 4
    teacher = torch.randn(latent, 10, generator=g)
    z = torch.randn(train + test, latent, generator=g)
    x = (z @ projection + 0.1 * torch.randn(train + test, 784, generator=g)).view(-1, 1, 28, 28)
    y = (z @ teacher).argmax(dim=1)
    return Dataset(x[:train], y[:train], x[train:], y[train:])


def train_size(name: str, data_dir: str | Path | None = None) -> int:
    """Samples in the training set, read from the label file's header only.

    Raises:
        DataUnavailable: the file is missing or not an IDX label file.
    """
    if name == "synthetic":
        return SYNTHETIC_TRAIN
    root = Path(data_dir) if data_dir else default_data_dir()
    path = _find(root, _FILES["train_y"])
    if path is None:
        load_idx_folder(root)  # raises the full message naming what is missing
        raise AssertionError("unreachable")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != b"\x00\x00\x08\x01":
        raise DataUnavailable(f"{path} is not an IDX label file.")
    return int.from_bytes(head[4:8], "big")


def load(name: str, data_dir: str | Path | None = None, seed: int = 0) -> Dataset:
    """The data set named ``fashion-mnist`` or ``synthetic``."""
    if name == "synthetic":
        return synthetic(seed=seed)
    return load_idx_folder(data_dir)


def batches_per_epoch(n_samples: int, batch_size: int) -> int:
    """Whole batches in one pass over ``n_samples``; the remainder is dropped."""
    return n_samples // batch_size


def epoch_permutation(n_samples: int, epoch: int, seed: int) -> torch.Tensor:
    """The seeded order of the training set in ``epoch``: the same on every worker."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_samples, generator=g)


def batch_indices(n_samples: int, seed: int, batch_size: int, batch: int) -> torch.Tensor:
    """Sample indices of the run's global batch ``batch`` (see ``paramserver.dataplan``)."""
    epoch, position = divmod(batch, batches_per_epoch(n_samples, batch_size))
    perm = epoch_permutation(n_samples, epoch, seed)
    return perm[position * batch_size : (position + 1) * batch_size]
