"""Model factories by name and by module:function."""

from __future__ import annotations

import sys

import pytest
import torch

from paramserver import models
from paramserver.errors import ConfigError


@pytest.mark.parametrize(
    "name,params", [("mlp", 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10), ("cnn", None)]
)
def test_builtin_models_take_28x28_images(name, params):
    model = models.build(name, seed=0)
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    if params is not None:
        assert sum(p.numel() for p in model.parameters()) == params


def test_seed_makes_weights_reproducible():
    a, b = models.build("cnn", seed=4), models.build("cnn", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_module_function_factory():
    model = models.build("tests.integration.test_large_model:big_model")
    assert model[0].in_features == 4096


@pytest.mark.parametrize(
    "spec,message",
    [
        ("resnet50", "Unknown model 'resnet50': use one of mlp, cnn, resnet"),
        ("no_such_module_xyz:f", "Cannot import module 'no_such_module_xyz'"),
        ("paramserver.models:nothing", "has no function 'nothing'"),
        ("paramserver.training.data:default_data_dir", "returned PosixPath, not a torch.nn.Module"),
    ],
)
def test_bad_model_specs_are_clear(spec, message):
    with pytest.raises(ConfigError, match=message):
        models.build(spec)


def test_sparse_embeddings_are_tables_outside_the_flat_buffer():
    from torch import nn

    from paramserver import models
    from paramserver.errors import ConfigError

    model = nn.Sequential(
        nn.Embedding(10, 4, sparse=True),
        nn.Linear(4, 2),
        nn.EmbeddingBag(7, 3, sparse=True),
        nn.Embedding(5, 2),
    )
    assert [n for n, _ in models.parameters(model)] == ["1.weight", "1.bias", "3.weight"]
    assert [(t.name, t.rows, t.dim) for t in models.table_specs(model)] == [
        ("0", 10, 4),
        ("2", 7, 3),
    ]
    model[0].requires_grad_(False)  # frozen: a constant, neither a table nor pushed
    assert [t.name for t in models.table_specs(model)] == ["2"]
    with pytest.raises(ConfigError, match="padding_idx"):
        models.table_specs(nn.Sequential(nn.Embedding(10, 4, sparse=True, padding_idx=0)))


def test_a_model_module_in_the_current_folder_is_found(tmp_path, monkeypatch):
    """As ``python -m`` finds it: the ``paramserver`` script has its own folder on
    ``sys.path``, not the current one (issue 46)."""
    from paramserver.models.catalogue import import_function

    (tmp_path / "mymod_here.py").write_text(
        "from torch import nn\n\ndef model():\n    return nn.Linear(784, 10)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert isinstance(import_function("mymod_here:model", "model")(), torch.nn.Linear)
    with pytest.raises(ConfigError) as exc:
        import_function("not_a_module_anywhere:model", "model")
    assert f"looked in the current folder ({tmp_path})" in str(exc.value)
