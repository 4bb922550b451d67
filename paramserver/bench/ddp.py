"""The DDP baseline: ``python -m paramserver.bench.ddp RANK WORLD PORT STEPS BATCH DELAY OUT``.

One process of a torch.distributed data-parallel run (gloo on CPU, nccl on CUDA) training
the MLP on random data for STEPS steps, sleeping DELAY seconds per step (a straggler), and
writing {"rank", "steps", "samples", "seconds"} as JSON to OUT.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from paramserver import models
from paramserver.config import OptimizerConfig
from paramserver.store import build_optimizer


def main(argv: list[str]) -> None:
    rank, world, port, steps, batch = (int(a) for a in argv[:5])
    delay, out = float(argv[5]), argv[6]
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=world,
    )  # fmt: skip
    model = DistributedDataParallel(models.build("mlp", seed=0).to(device))
    opt = build_optimizer(list(model.parameters()), OptimizerConfig("adam"))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 1, 28, 28, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()  # all_reduce of the gradients
        if delay:
            time.sleep(delay)  # the injected straggler, as `paramserver worker --step-delay`
        opt.step()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"rank": rank, "steps": steps, "samples": steps * batch, "seconds": seconds}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
