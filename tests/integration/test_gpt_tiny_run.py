"""``gpt-tiny`` on ``--dataset text`` through the built-in worker (issue 58, must 3), with
overlapped local steps: the servers' weights come back with the head still tied and a test
perplexity below the untrained model's."""

from __future__ import annotations

import torch

import paramserver as ps
from paramserver import models
from paramserver.config import WorkerConfig
from paramserver.training import data, evaluation
from paramserver.training.trainer import run
from tests.conftest import WorkerThread

STEPS, H, BATCH = 6, 4, 32


def test_gpt_tiny_trains_on_text_with_overlapped_local_steps(serve):
    server = serve(
        "gpt-tiny",
        dataset="text",
        batch_size=BATCH,
        epochs=1,
        seed=1,
        policy="sync",
        workers=2,
        optimizer="nesterov",
        lr=0.7,
        momentum=0.9,
    )
    cfg = WorkerConfig(
        server.address,
        device="cpu",
        push_every=H,
        inner_optimizer="adamw",
        overlap="on",
        max_steps=STEPS,
    )
    threads = [WorkerThread(lambda: run(cfg), f"w{r}") for r in range(2)]
    for t in threads:
        t.start()
    summaries = [t.result() for t in threads]
    assert [s.steps for s in summaries] == [STEPS, STEPS]
    status = server.status()
    assert status["batches_done"] == 2 * STEPS * H == status["batches_applied"]
    state = ps.model_state_dict(server.address, "gpt-tiny")
    assert torch.equal(state["head.weight"], state["tok.weight"])
    trained = models.build("gpt-tiny", seed=0)
    trained.load_state_dict(state, strict=True)
    assert trained.head.weight is trained.tok.weight
    ds = data.load("text")
    x, y = ds.test_x[:256], ds.test_y[:256]
    before = evaluation.evaluate(models.build("gpt-tiny", seed=1), x, y).perplexity
    after = evaluation.evaluate(trained, x, y).perplexity
    assert before is not None and after is not None
    assert after < 0.5 * before, (before, after)  # 48 batches of 32 learnt the bytes' spread
