"""Data sets (Fashion-MNIST from IDX files, a seeded synthetic one, the synthetic click log,
users' own) and the shared sharding."""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from paramserver import models
from paramserver.errors import ConfigError, DataUnavailable
from paramserver.training import clicks, text

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
    """Inputs (images as float32 (N, 1, 28, 28); click logs' ids as int64 (N, fields);
    text as int64 bytes (N, T)) and labels as int64 (N,) (text: the next bytes, (N, T))."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def train_size(self) -> int:
        return len(self.train_x)

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training samples at ``idx``: inputs and labels."""
        return self.train_x.index_select(0, idx), self.train_y.index_select(0, idx)

    def test_batches(self, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, len(self.test_x), size):
            yield self.test_x[i : i + size], self.test_y[i : i + size]


class UserDataset:
    """A user's data: ``module:function`` returning ``(train, test)``, two map-style torch
    Datasets of ``(input, label)`` pairs, batched with torch's default collate."""

    def __init__(self, spec: str, train: Any, test: Any):
        self.spec, self.train, self.test = spec, train, test

    @property
    def train_size(self) -> int:
        return len(self.train)

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = default_collate([self.train[i] for i in idx.tolist()])
        return x, y

    def test_batches(self, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, len(self.test), size):
            x, y = default_collate([self.test[j] for j in range(i, min(i + size, len(self.test)))])
            yield x, y


def load_user(spec: str) -> UserDataset:
    """Call the factory ``module:function`` and check what it returns.

    Raises:
        ConfigError: it cannot be imported, or does not return (train, test) of pairs.
        DataUnavailable: it raised.
    """
    factory = models.import_function(spec, "dataset")
    try:
        made = factory()
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure, one sentence
        raise DataUnavailable(
            f"Dataset factory {spec!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    shape = "(train, test), two map-style torch Datasets of (input, label) pairs"
    if not isinstance(made, tuple | list) or len(made) != 2:
        raise ConfigError(f"Dataset factory {spec!r} returned {type(made).__name__}, not {shape}.")
    for part, name in zip(made, ("train", "test"), strict=True):
        if not hasattr(part, "__len__") or not hasattr(part, "__getitem__") or len(part) < 1:
            raise ConfigError(f"Dataset factory {spec!r}: its {name} set is not {shape}.")
        first = part[0]
        if not isinstance(first, tuple | list) or len(first) != 2:
            raise ConfigError(
                f"Dataset factory {spec!r}: item 0 of its {name} set is "
                f"{type(first).__name__}, not an (input, label) pair."
            )
    return UserDataset(spec, made[0], made[1])


Data = Dataset | UserDataset


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
    """Samples in the training set, read from the label file's header only (a user's data
    set is loaded).

    Raises:
        DataUnavailable: the file is missing or not an IDX label file.
    """
    if name == "synthetic":
        return SYNTHETIC_TRAIN
    if name == "clicks":
        return clicks.TRAIN
    if name == "text":
        return text.train_size()
    if ":" in name:
        return load_user(name).train_size
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


def load(name: str, data_dir: str | Path | None = None, seed: int = 0) -> Data:
    """The data set named ``fashion-mnist``, ``synthetic``, ``clicks``, ``text`` or
    ``module:function``."""
    if ":" in name:
        return load_user(name)
    return load_builtin(name, data_dir, seed)


def load_builtin(name: str, data_dir: str | Path | None = None, seed: int = 0) -> Dataset:
    """``fashion-mnist`` (or MNIST from ``data_dir``), ``synthetic``, ``clicks`` or
    ``text`` (``training/text.py``), as tensors."""
    if name == "synthetic":
        return synthetic(seed=seed)
    if name == "clicks":
        return Dataset(*clicks.make(seed=seed))
    if name == "text":
        return Dataset(*text.split(text.corpus()))
    return load_idx_folder(data_dir)


def batches_per_epoch(n_samples: int, batch_size: int) -> int:
    """Whole batches in one pass over ``n_samples``; the remainder is dropped."""
    return n_samples // batch_size


def epoch_permutation(n_samples: int, epoch: int, seed: int) -> torch.Tensor:
    """The seeded order of the training set in ``epoch``: the same on every worker."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_samples, generator=g)


def batch_indices(n_samples: int, seed: int, batch_size: int, batch: int) -> torch.Tensor:
    """Sample indices of the run's global batch ``batch`` (see ``paramserver.server.bookkeeping.batch_queue``)."""
    epoch, position = divmod(batch, batches_per_epoch(n_samples, batch_size))
    perm = epoch_permutation(n_samples, epoch, seed)
    return perm[position * batch_size : (position + 1) * batch_size]
