"""``bench network --only``: which training variants run beside DDP, decided before any
namespace is made; and the local-step variants' outer optimizer (issue 45)."""

from __future__ import annotations

import click
import pytest

from paramserver.bench.common import local_outer
from paramserver.bench.wire.network_training import VARIANTS, chosen


def test_only_names_the_variants_that_run_and_refuses_others():
    assert chosen("") == VARIANTS
    assert list(chosen(" local32_int8 , topk")) == ["local32_int8", "topk"]
    with pytest.raises(click.UsageError, match="no variant fp64; there are fp32, "):
        chosen("local32_int8,fp64")


def test_local_steps_decay_nesterov_under_sync_and_its_delayed_form_otherwise():
    sync, late = local_outer("sync", 100), local_outer("async", 100)
    assert (sync.name, late.name) == ("nesterov", "delayed-nesterov")
    for cfg in (sync, late):
        assert (cfg.lr, cfg.momentum, cfg.schedule, cfg.total_steps, cfg.by) == (
            0.7,
            0.9,
            "cosine",
            100,
            "batches",
        )
    assert local_outer("ssp:2").name == "delayed-nesterov"
    assert local_outer("sync").schedule == "constant"  # a throughput window: no plan
