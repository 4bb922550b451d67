"""A server resumed from its checkpoint steps with the command line's optimizer settings,
not the checkpoint's (the log names those that changed), and refuses another optimizer's
state in one line unless ``--switch-optimizer`` starts it afresh; unsharded, and shard 0
of 2 from its cut."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from torch import nn

from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.errors import ConfigError
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.build import build_coordinator
from paramserver.server.disk import checkpoint
from paramserver.server.disk.checkpoint_writer import Checkpointer
from tests.conftest import FakeClock

LR = 0.1
SHARDS = [1, 2]  # one server; shard 0 of 2, which resumes from its newest cut


def _config(tmp_path, optimizer: OptimizerConfig, shards: int, **kw) -> ServerConfig:
    return ServerConfig(
        policy="sync",
        workers=1,
        shard=0,
        shards=shards,
        checkpoint_dir=str(tmp_path),
        checkpoint_every="1",
        optimizer=optimizer,
        **kw,
    )


def _model() -> nn.Module:
    nn.init.zeros_((model := nn.Linear(4, 1, bias=False)).weight)
    return model


def _push(c, worker: str) -> None:
    """One push of a gradient of ones from ``worker``: one sync round, one optimizer step."""
    clock = c.membership.get(worker).clock
    c.push(worker, clock, np.ones(c.manifest.numel, np.float32), 1, 0.0)


def _checkpointed(tmp_path, optimizer: OptimizerConfig, shards: int, pushes: int) -> None:
    """A run of ``optimizer`` that pushed ``pushes`` times, then stopped (its last
    checkpoint, or cut)."""
    c = build_coordinator(_config(tmp_path, optimizer, shards), _model(), now=FakeClock())
    saver = Checkpointer(c, tmp_path, "1", cuts=shards > 1).start()
    a = c.join("a")
    for _ in range(pushes):
        _push(c, a.worker_id)
    saver.stop()


def _resumed(tmp_path, optimizer: OptimizerConfig, shards: int, **kw):
    config = _config(tmp_path, optimizer, shards, forget_workers=True, **kw)
    return build_coordinator(config, _model(), now=FakeClock(), resume=True)


def _update(c) -> np.ndarray:
    """What one push of ones from a new worker moves the resumed weights by."""
    before = c.store.weights[: c.store.n_params].copy()
    _push(c, c.join("b").worker_id)
    return c.store.weights[: c.store.n_params] - before


@pytest.mark.parametrize("shards", SHARDS)
def test_a_resume_steps_with_the_new_momentum_and_says_so(tmp_path, shards, caplog):
    _checkpointed(tmp_path, OptimizerConfig("momentum", LR, momentum=0.9), shards, pushes=3)
    with caplog.at_level(logging.INFO):
        c = _resumed(tmp_path, OptimizerConfig("momentum", LR, momentum=0.5), shards)
    # three pushes of ones under 0.9 left the buffer at 1 + 0.9 + 0.81 = 2.71; the next at
    # the new momentum: buffer 0.5 * 2.71 + 1 = 2.355 (the checkpoint's 0.9 gave 3.439)
    np.testing.assert_allclose(_update(c), -LR * 2.355, rtol=1e-6)
    assert "--momentum 0.9 -> 0.5" in caplog.text


@pytest.mark.parametrize("shards", SHARDS)
def test_a_resume_steps_with_the_new_delayed_nesterov_period(tmp_path, shards, caplog):
    before = OptimizerConfig("delayed-nesterov", LR, momentum=0.9, period=2)
    _checkpointed(tmp_path, before, shards, pushes=2)  # the momentum moved at push 2
    with caplog.at_level(logging.INFO):
        c = _resumed(tmp_path, OptimizerConfig("delayed-nesterov", LR, 0.9, period=4), shards)
    # push 3 moves no momentum under either period: lr/4 at the new one (lr/2 at the old)
    np.testing.assert_allclose(_update(c), -LR / 4, rtol=1e-6)
    assert "--nesterov-period 2 -> 4" in caplog.text


@pytest.mark.parametrize("shards", SHARDS)
@pytest.mark.parametrize(
    "written,given",
    [("adam", "sgd"), ("nesterov", "delayed-nesterov"), ("delayed-nesterov", "nesterov")],
)
def test_another_optimizer_is_refused_in_one_line_naming_both(tmp_path, shards, written, given):
    _checkpointed(tmp_path, OptimizerConfig(written, LR), shards, pushes=2)
    with pytest.raises(ConfigError) as refused:
        _resumed(tmp_path, OptimizerConfig(given, LR), shards)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"The checkpoint in {tmp_path} was written by a server of ")
    assert f"--optimizer {written}, whose state --optimizer {given} cannot go on" in message
    assert "give --switch-optimizer" in message


@pytest.mark.parametrize("shards", SHARDS)
@pytest.mark.parametrize("written,given", [("adam", "momentum"), ("nesterov", "delayed-nesterov")])
def test_switch_optimizer_keeps_the_weights_and_starts_the_state_afresh(
    tmp_path, shards, written, given
):
    _checkpointed(tmp_path, OptimizerConfig(written, LR), shards, pushes=2)
    cfg = OptimizerConfig(given, LR, period=1 if given == "delayed-nesterov" else 0)
    c = _resumed(tmp_path, cfg, shards, switch_optimizer=True)
    assert c.store.version == 2 and c.store.optimizer.state[c.store.param] == {}
    weights = c.store.weights.copy()
    assert np.all(weights != 0)  # the checkpoint's weights, not the model's zeros
    fresh = ParameterStore(c.manifest, weights, cfg)  # the same optimizer, never stepped
    fresh.apply(np.ones(c.manifest.numel, np.float32))
    np.testing.assert_allclose(_update(c), fresh.weights - weights, rtol=1e-6)
    assert c.store.version == 3
    # its next checkpoint is the new optimizer's: a restart with the flag keeps its state
    assert c.store.resumes(c.store.optimizer_state())


OTHER = {"sgd": "adam", "momentum": "adamw", "nesterov": "momentum"}
OTHER |= {"delayed-nesterov": "nesterov", "adam": "adamw", "adamw": "delayed-nesterov"}


@pytest.mark.parametrize("name", sorted(OTHER))
def test_a_checkpoint_from_before_the_record_is_told_by_its_parameter_group(name):
    """Checkpoints written before ``settings`` was: the optimizer is told by its torch
    parameter group, and its momentum (not its lr: the last step's rate) compared."""
    manifest = Manifest.from_tensors([("w", torch.zeros(4))])
    old = ParameterStore(manifest, np.zeros(4, np.float32), OptimizerConfig(name, LR))
    old.apply(np.ones(4, np.float32))
    state = old.optimizer_state()
    del state["settings"]  # as written before the record
    ParameterStore(manifest, old.weights.copy(), OptimizerConfig(name, LR)).restore(
        old.weights.copy(), state, old.version
    )
    other = ParameterStore(manifest, old.weights.copy(), OptimizerConfig(OTHER[name], LR))
    # plain SGD's group is momentum's at --momentum 0: "sgd or momentum"
    with pytest.raises(ConfigError, match=f"--optimizer {name}( or momentum)?, whose state"):
        other.restore(old.weights.copy(), state, old.version)


def test_a_store_restored_from_an_older_checkpoint_takes_the_new_momentum(caplog):
    manifest = Manifest.from_tensors([("w", torch.zeros(4))])
    old = ParameterStore(manifest, np.zeros(4, np.float32), OptimizerConfig("momentum", LR))
    old.apply(np.ones(4, np.float32))
    state = old.optimizer_state()
    del state["settings"]
    new = ParameterStore(
        manifest, np.zeros(4, np.float32), OptimizerConfig("momentum", LR, momentum=0.5)
    )
    with caplog.at_level(logging.INFO):
        new.restore(old.weights.copy(), state, old.version)
    assert "--momentum 0.9 -> 0.5" in caplog.text
    before = new.weights.copy()
    new.apply(np.ones(4, np.float32))
    np.testing.assert_allclose(new.weights - before, -LR * 1.5, rtol=1e-6)  # 0.5 * 1 + 1


def test_the_checkpoint_records_the_settings_it_was_written_with(tmp_path):
    cfg = OptimizerConfig("delayed-nesterov", LR, momentum=0.7, period=3)
    _checkpointed(tmp_path, cfg, 1, pushes=1)
    saved = checkpoint.load(tmp_path / checkpoint.server_file())["optimizer_state"]
    assert saved["settings"] == {k: v for k, v in dataclasses.asdict(cfg).items() if k != "factory"}
