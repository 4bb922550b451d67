"""Users' data sets: ``--dataset module:function`` returning (train, test) map-style torch
Datasets; whatever goes wrong is one sentence that names the factory."""

from __future__ import annotations

import pytest
import torch

from paramserver.config import ServerConfig
from paramserver.errors import ConfigError, DataUnavailable
from paramserver.training import data


def test_a_users_data_set_batches_like_the_built_in_ones():
    ds = data.load("tests.user_data:small")
    assert ds.train_size == 512 and data.train_size("tests.user_data:small") == 512
    x, y = ds.batch(torch.tensor([3, 1, 4]))
    assert x.shape == (3, 1, 28, 28) and y.dtype == torch.int64
    reference = data.synthetic(train=512, test=128, seed=5)
    assert torch.equal(x, reference.train_x[[3, 1, 4]])
    sizes = [len(y) for _, y in ds.test_batches(50)]
    assert sizes == [50, 50, 28]


@pytest.mark.parametrize(
    ("spec", "error", "needle"),
    [
        ("tests.no_such_module:small", ConfigError, "Cannot import module 'tests.no_such_module'"),
        ("tests.user_data:missing", ConfigError, "has no function 'missing'"),
        ("tests.user_data:broken", DataUnavailable, "failed: OSError: the bucket is not mounted"),
        ("tests.user_data:one_set", ConfigError, "returned TensorDataset, not (train, test)"),
        ("tests.user_data:not_pairs", ConfigError, "not an (input, label) pair"),
    ],
)
def test_a_bad_data_set_factory_is_named_in_one_sentence(spec, error, needle):
    with pytest.raises(error) as info:
        data.load(spec)
    message = str(info.value)
    assert needle in message and spec in message and "\n" not in message


def test_the_dataset_setting_takes_module_function():
    assert ServerConfig(dataset="tests.user_data:small").dataset == "tests.user_data:small"
    with pytest.raises(
        ConfigError, match="fashion-mnist, synthetic, clicks, text, or module:function"
    ):
        ServerConfig(dataset="imagenet")
