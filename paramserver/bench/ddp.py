"""The DDP baseline: ``python -m paramserver.bench.ddp RANK WORLD PORT STEPS BATCH DELAY OUT``.

One process of a torch.distributed data-parallel run (gloo on CPU, nccl on CUDA) training
the MLP on random data for STEPS steps, the last rank sleeping DELAY seconds per step (a
straggler), and
writing {"rank", "steps", "samples", "seconds"} as JSON to OUT.

`run_ranks` starts the ranks of such a baseline (this one or the accuracy bench's) and
collects what they wrote; `write_result`, `worker_figures` and `peak_rss_mb` are what every
bench's rank processes (the tables' and the Criteo case's too) report with. Every rank writes its result before it tears the process group
down, after a barrier: gloo's teardown can abort a process ("terminate called without an
active exception") once in a while on a loaded machine, and a rank that finished its
measurement should not lose it to that. A rank that exits non-zero without its result fails
the benchmark with the tail of its log.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from paramserver import models
from paramserver.cluster.procs import Forked
from paramserver.cluster.procs import start as start_child
from paramserver.config import OptimizerConfig
from paramserver.server.bookkeeping.store import build_optimizer

MASTER_ENV = "PARAMSERVER_DDP_MASTER"
LOCAL_MASTER = "127.0.0.1"


def main(argv: list[str]) -> None:
    rank, world, port, steps, batch = (int(a) for a in argv[:5])
    delay = float(argv[5]) if rank == world - 1 else 0.0
    out = argv[6]
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://{master()}:{port}",
        rank=rank,
        world_size=world,
    )
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
    write_result(out, {"rank": rank, "steps": steps, "samples": steps * batch, "seconds": seconds})
    finish()


def write_result(out: str | Path, result: Any) -> None:
    """Write a rank's result atomically: a file that exists is complete."""
    tmp = Path(f"{out}.tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)


def worker_figures(
    worker: Any, rank: int, steps: int, batch: int, started: float, cpu_started: float
) -> dict[str, Any]:
    """A bench worker's result once its steps are flushed: steps, samples, seconds since
    ``started``, the CPU seconds this process used since ``cpu_started`` (every thread's,
    ``time.process_time``), and the rows it fetched and pushed (its peak memory is added
    after it left)."""
    counters = worker.tables.counters
    return {
        "rank": rank,
        "steps": steps,
        "samples": steps * batch,
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu_started,
        "rows_fetched": counters.fetched,
        "rows_pushed": counters.pushed,
        "dense_numel": worker.manifest.numel,
    }


def peak_rss_mb(field: str = "VmHWM") -> float:
    """This process's peak resident memory (VmHWM; "VmRSS": now), in MiB."""
    found = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(found.group(1)) / 1024 if found else float("nan")


def finish() -> None:
    """Tear the process group down once every rank is past its last collective."""
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    module: str,
    args: list[str],
    world: int,
    logs: Path,
    name: str,
    timeout: float,
    place: Callable[[int], tuple[list[str], dict[str, str]]] | None = None,
    master: str = LOCAL_MASTER,
) -> list[Any]:
    """Run ``python -m MODULE RANK WORLD PORT *ARGS OUT`` for every rank; their results.
    ``place(rank)``: the command prefix and environment that put a rank on its host (a
    network namespace), whose rank 0 listens on ``master``.

    Raises RuntimeError naming the rank and its log's tail if a rank fails before writing
    its result or does not finish within ``timeout`` seconds.
    """
    port = free_port()
    outs = [logs / f"{name}-{rank}.json" for rank in range(world)]
    for out in outs:
        out.unlink(missing_ok=True)
    log_paths = [logs / f"{name}-{rank}.log" for rank in range(world)]
    procs = []
    try:
        for rank in range(world):
            argv = [str(rank), str(world), str(port), *args, str(outs[rank])]
            prefix, env = place(rank) if place else ([], {})
            env = {**env, MASTER_ENV: master}
            procs.append(start_rank(module, argv, log_paths[rank], prefix, env))
        for rank, p in enumerate(procs):
            check_rank(p, timeout, outs[rank], log_paths[rank], f"{name} rank {rank}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(out.read_text()) for out in outs]


def start_rank(
    module: str,
    argv: list[str],
    log_path: Path,
    prefix: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen | Forked:
    """``python -m MODULE *ARGV`` after ``prefix``, its stderr into ``log_path``."""
    with open(log_path, "wb") as log:
        return start_child(  # forked from the zygote: no seconds of imports per rank
            [*(prefix or []), sys.executable, "-m", module, *argv],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, **(env or {})},
        )


def master() -> str:
    """The address rank 0 listens on (``run_ranks`` sets it)."""
    return os.environ.get(MASTER_ENV, LOCAL_MASTER)


def check_rank(
    p: subprocess.Popen | Forked, timeout: float, out: Path, log_path: Path, who: str
) -> None:
    """Wait up to ``timeout`` seconds for the rank ``who`` that ``p`` runs to finish.

    Raises RuntimeError with its log's tail if it did not finish, or failed before writing
    its result ``out``; warns if it failed after.
    """
    try:
        code = p.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    if code == 0:
        return
    tail = log_path.read_text(errors="replace")[-800:]
    if code is None or not out.exists():
        what = "did not finish" if code is None else f"failed (exit {code})"
        raise RuntimeError(f"{who} {what}: {tail}")
    print(
        f"warning: {who} exited {code} after writing its result "
        f"(process-group teardown): {tail.strip()[-200:]}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
