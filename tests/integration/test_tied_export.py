"""A user's GPT with its output head tied to the token embedding (issue 56, must 1): the
servers carry the tied weight once, and every way the model comes back (``ps.model_state_dict``,
``ServerApp.model_state_dict``, ``paramserver export``, a serving snapshot, one server or two
shards) holds it
under both names with the trained values, so a strict load gives the trained model. Before,
the head's name kept its initial values, and a strict load overwrote the trained embedding."""

from __future__ import annotations

import pytest
import torch

import paramserver as ps
from paramserver import models
from paramserver.server.disk.export import export
from paramserver.server.disk.reshard import reshard
from paramserver.serving import snapshot
from tests import gpt

SEED, STEPS = 3, 8
# a user's GPT, and the zoo's gpt-tiny (issue 58): both tie the head to the token embedding
# (the test's 32-token text fits gpt-tiny's 256 bytes and 64 positions)
MODELS = ["tests.gpt:gpt", "gpt-tiny"]


def _train(serve, directory, shards: int, spec: str) -> tuple[list[ps.ServerApp], torch.nn.Module]:
    servers = [
        serve(
            spec,
            seed=SEED,
            optimizer="adam",
            lr=0.01,
            policy="sync",
            workers=1,
            shard=i,
            shards=shards,
            checkpoint_dir=str(directory),
            checkpoint_every="100",
        )
        for i in range(shards)
    ]
    model = models.build(spec, seed=SEED)
    x, y = gpt.text(16 * STEPS, seed=1)
    with ps.Worker([s.address for s in servers], model, overlap=False) as worker:
        for i in range(STEPS):
            gpt.loss(model, x[16 * i : 16 * (i + 1)], y[16 * i : 16 * (i + 1)]).backward()
            worker.step(samples=16)
    return servers, model


def _loads_as_trained(
    state: dict[str, torch.Tensor], trained: torch.Tensor, what: str, spec: str
) -> float:
    """The validation loss of a fresh model (another seed) loaded strictly from ``state``,
    after checking that both names of the tied weight hold the trained values."""
    assert "head.weight" in state, f"{what}: the tied head's name is missing"
    for name in ("tok.weight", "head.weight"):
        torch.testing.assert_close(state[name], trained, msg=f"{what}: {name}")
    fresh = models.build(spec, seed=0)
    fresh.load_state_dict(state, strict=True)
    assert fresh.head.weight is fresh.tok.weight  # still tied
    torch.testing.assert_close(fresh.tok.weight.detach(), trained, msg=what)
    x, y = gpt.text(64, seed=9)
    with torch.no_grad():
        return float(gpt.loss(fresh.eval(), x, y))


@pytest.mark.parametrize(("spec", "shards"), [(MODELS[0], 1), (MODELS[0], 2), (MODELS[1], 2)])
def test_a_tied_head_comes_back_trained_under_both_names(serve, tmp_path, spec, shards):
    servers, _ = _train(serve, tmp_path, shards, spec)
    initial = models.build(spec, seed=SEED).tok.weight.detach()
    read = ps.model_state_dict([s.address for s in servers], spec)
    trained = read["tok.weight"]
    assert not torch.allclose(trained, initial), "the embedding did not train"
    losses = [_loads_as_trained(read, trained, "ps.model_state_dict", spec)]
    if shards == 1:
        losses.append(_loads_as_trained(servers[0].model_state_dict(), trained, "ServerApp", spec))
    for s in servers:
        s.stop()  # each writes its last checkpoint
    path, _, _ = export(tmp_path, spec, SEED, tmp_path / "model.pt")
    exported = torch.load(path, weights_only=True)["model_state_dict"]
    losses.append(_loads_as_trained(exported, trained, "paramserver export", spec))
    if shards == 2:  # resharded onto 3 shards and onto 1, the tied weight is still one
        for count in (3, 1):
            out = tmp_path / f"reshard-{count}"
            reshard(tmp_path, spec, SEED, count, out)
            path, _, _ = export(out, spec, SEED, out / "model.pt")
            again = torch.load(path, weights_only=True)["model_state_dict"]
            losses.append(_loads_as_trained(again, trained, f"resharded onto {count}", spec))
    root, _, _ = snapshot.write(tmp_path, spec, SEED, tmp_path / "snap")
    served = ps.serving.load(root)  # a serving snapshot: the dense part, by name
    assert served.head.weight is served.tok.weight
    losses.append(_loads_as_trained(served.state_dict(), trained, "a serving snapshot", spec))
    assert max(losses) - min(losses) < 1e-6, losses
