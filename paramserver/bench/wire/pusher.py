"""A load generator for ``bench server``: a Worker that pushes one prepared gradient over
and over, no model compute, through the channel a worker would use (a shared segment on the
same host, or the data port).

Run as ``python -m paramserver.bench.wire.pusher ADDRESSES NBYTES SHM NAME``: ADDRESSES the
shards' comma-separated, NBYTES the model's size, SHM ``on`` (a shared segment) or ``off``
(the data port). It pushes until it is killed, and dies with the process that started it.
"""

from __future__ import annotations

import logging
import sys

import torch

from paramserver.bench.wire.transport import Blob
from paramserver.cluster.procs import die_with_parent_if_asked
from paramserver.worker.worker import Worker


def main(argv: list[str]) -> None:
    die_with_parent_if_asked()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    addresses, nbytes, shm, name = argv[0].split(","), int(argv[1]), argv[2] == "on", argv[3]
    torch.set_num_threads(1)
    model = Blob(nbytes)
    grad = torch.full_like(model.w, 1e-3)
    worker = Worker(addresses, model, shm=shm, overlap=False, name=name)
    if worker.shm_active != shm or worker.data_port_active == shm:
        raise SystemExit(f"{name}: the pushes took the wrong path (shm {shm} asked)")
    while True:
        model.w.grad = grad
        # never pulls: returns once the push is applied (shared memory) or accepted (the
        # data port answers a push alone before its apply)
        worker.step(samples=1, pull=False)


if __name__ == "__main__":
    main(sys.argv[1:])
