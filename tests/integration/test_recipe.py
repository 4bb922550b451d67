"""A transformer recipe as a PyTorch user writes it, on the servers (issue 56's target): a
GPT-style model with a tied head, AdamW with two parameter groups (decay 0.1 on the
matrices, none on biases, norms and embeddings), betas (0.9, 0.95), 20 warmup steps then
cosine to 10%, a global-norm clip of 1.0 and accumulation over 2 micro-batches. Two sync
workers through ``ps.serve`` match one local process running the same recipe with torch's
own AdamW, LambdaLR and clip_grad_norm_, step for step, and the export loads strictly into
the user's model with the same validation loss."""

from __future__ import annotations

import copy

import torch

import paramserver as ps
from tests import gpt
from tests.conftest import WorkerThread

STEPS, MICRO, WORKERS, LR = 100, 8, 2, 3e-3
RECIPE = {
    "optimizer": "adamw",
    "lr": LR,
    "weight_decay": 0.1,
    "weight_decay_on": "matrices",
    "adam_betas": "0.9,0.95",
    "clip_grad_norm": 1.0,
    "lr_warmup": 20,
    "lr_schedule": "cosine",
    "lr_total_steps": STEPS,
    "lr_floor": 0.1,
}
X, Y = gpt.text(STEPS * WORKERS * 2 * MICRO, seed=5)


def micro(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return X[k * MICRO : (k + 1) * MICRO], Y[k * MICRO : (k + 1) * MICRO]


def _local(model: torch.nn.Module) -> torch.nn.Module:
    """One process: each step the 4 micro-batches of both workers, accumulated."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(gpt.groups(ref, 0.1), lr=LR, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, gpt.warmup_cosine(20, STEPS, 0.1))
    for t in range(STEPS):
        opt.zero_grad()
        for k in range(WORKERS * 2):
            (gpt.loss(ref, *micro(WORKERS * 2 * t + k)) / (WORKERS * 2)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        sched.step()
    return ref


def test_a_transformer_recipe_on_two_sync_workers_is_the_local_run(serve):
    torch.manual_seed(0)
    model = gpt.GPT(dropout=0.0)
    server = serve(model, policy="sync", workers=WORKERS, **RECIPE)

    def worker(rank: int) -> None:
        mine = copy.deepcopy(model)
        with ps.Worker(server.address, mine, overlap=False) as w:
            for t in range(STEPS):
                for m in range(2):  # accumulation over 2 micro-batches
                    (gpt.loss(mine, *micro(WORKERS * 2 * t + 2 * rank + m)) / 2).backward()
                w.step(samples=2 * MICRO)

    threads = [WorkerThread(lambda r=r: worker(r), f"worker-{r}") for r in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.result()
    ref = _local(model)
    served = server.model_state_dict()
    worst = max((served[n] - v).abs().max().item() for n, v in ref.state_dict().items())
    assert worst <= 1e-3, worst
    fresh = gpt.GPT(dropout=0.0)
    fresh.load_state_dict(served, strict=True)  # the export: every name, the tied head too
    vx, vy = gpt.text(256, seed=11)
    with torch.no_grad():
        got, want = gpt.loss(fresh.eval(), vx, vy).item(), gpt.loss(ref.eval(), vx, vy).item()
    assert abs(got - want) <= 1e-4, (got, want)
    start = gpt.loss(model.eval(), vx, vy).item()
    assert want < start - 0.1, (want, start)  # it learnt something
    print(
        f"max |dparam| {worst:.2e}; validation loss {got:.4f} against {want:.4f} (from {start:.4f})"
    )
