"""Where a worker step's time goes: a raw push, a unary RPC, a pull, against a server child.

Run: .venv/bin/python docs/measure_rpc.py adam   (or sgd)
"""

import sys

import numpy as np
import torch

from paramserver import models
from paramserver._proto import paramserver_pb2 as pb
from paramserver.bench.common import median_seconds, server_process
from paramserver.codec import compression, wire
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.worker.worker import Worker


def main(optimizer: str) -> None:
    torch.set_num_threads(1)
    cfg = ServerConfig(optimizer=OptimizerConfig(optimizer), policy="async", lease_seconds=600)
    with server_process(cfg) as addr, Worker(addr, models.build("mlp", seed=0)) as w:
        grad = compression.as_bytes(np.full(w.manifest.numel, 1e-3, np.float32))
        session = w.sessions[0]

        def push() -> None:
            h = pb.PushHeader(
                worker_id=w.worker_id, iteration=w.clock, samples=1, incarnation=w.incarnation
            )
            chunks = wire.encode_push(h, grad, session.reply.chunk_bytes)
            session.stub.Push(chunks, timeout=60)
            session.clock += 1

        def heartbeat() -> None:
            session.stub.Heartbeat(pb.HeartbeatRequest(worker_id=w.worker_id))

        for name, call in (("push of the gradient", push), ("unary RPC (Heartbeat)", heartbeat),
                           ("pull (Worker.pull)", w.pull)):  # fmt: skip
            print(f"{optimizer}: {name}: {1000 * median_seconds(call, 200):.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "adam")
