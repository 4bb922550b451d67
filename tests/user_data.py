"""Data set factories as a user writes them, for ``--dataset tests.user_data:NAME``."""

from __future__ import annotations

from torch.utils.data import TensorDataset

from paramserver.training import data


def small() -> tuple[TensorDataset, TensorDataset]:
    """512 training and 128 test samples of the synthetic teacher, as map-style Datasets."""
    ds = data.synthetic(train=512, test=128, seed=5)
    return TensorDataset(ds.train_x, ds.train_y), TensorDataset(ds.test_x, ds.test_y)


def broken() -> None:
    raise OSError("the bucket is not mounted")


def one_set() -> TensorDataset:
    return small()[0]


def not_pairs() -> tuple[list, list]:
    ds = data.synthetic(train=8, test=8)
    return list(ds.train_x), list(ds.test_x)
