"""A server step's clip and matrices-only weight decay (``step_rules``) against torch with
two parameter groups and ``clip_grad_norm_``, for the coupled decay (SGD, Adam) and the
decoupled one (AdamW), one step after another."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from paramserver import models
from paramserver.config import OptimizerConfig
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.optim import step_rules
from tests import gpt


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_a_store_steps_as_torch_with_two_groups_and_a_clip(name, clip):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3), nn.LayerNorm(3))
    manifest, tensors = models.state(model)
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()
    cfg = OptimizerConfig(name, lr=0.1, weight_decay=0.2, decay_on="matrices", clip=clip)
    decayed = step_rules.decayed_ranges(model, manifest, 0, manifest.section("param")[1])
    assert [b - a for a, b in decayed] == [12]  # the Linear's weight alone
    store = ParameterStore(manifest, flat.copy(), cfg, decayed=decayed)
    ref = copy.deepcopy(model)
    kind = {"sgd": torch.optim.SGD, "momentum": torch.optim.SGD}.get(name)
    extra = {"momentum": 0.9} if name == "momentum" else {}
    kind = kind or (torch.optim.Adam if name == "adam" else torch.optim.AdamW)
    opt = kind(gpt.groups(ref, 0.2), lr=0.1, **extra)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in ref.parameters()]
        for p, grad in zip(ref.parameters(), grads, strict=True):
            p.grad = grad.clone()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        store.apply(torch.cat([x.reshape(-1) for x in grads]).numpy())
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()]).numpy()
    np.testing.assert_allclose(store.weights[: len(want)], want, rtol=1e-5, atol=1e-6)
