"""Where a worker step's time goes: a raw push, a unary RPC, a pull, against a server child.

Run: .venv/bin/python docs/measure_rpc.py adam   (or sgd)
"""

import time, torch, numpy as np

torch.set_num_threads(1)
from paramserver import models, codec
from paramserver._proto import paramserver_pb2 as pb
from paramserver.bench.common import server_process, median_seconds
from paramserver.worker.client import Worker
import sys

with server_process(
    "--model",
    "mlp",
    "--optimizer",
    sys.argv[1],
    "--policy",
    "async",
    "--workers",
    "1",
    "--lease-timeout",
    "600",
) as addr:
    model = models.build("mlp", seed=0)
    with Worker(addr, model) as w:
        g = codec.as_bytes(np.full(w.manifest.numel, 1e-3, np.float32))

        def push():
            h = pb.PushHeader(
                worker_id=w.worker_id, iteration=w.clock, samples=1, incarnation=w.incarnation
            )
            w._stub.Push(codec.encode_push(h, g, w.chunk_bytes), timeout=60)
            w.clock += 1

        print(sys.argv[1], "raw push", 1000 * median_seconds(push, 200))
        print("raw status", 1000 * median_seconds(lambda: w._stub.Status(pb.StatusRequest()), 200))
        print(
            "raw heartbeat",
            1000
            * median_seconds(
                lambda: w._stub.Heartbeat(pb.HeartbeatRequest(worker_id=w.worker_id)), 200
            ),
        )
        print("pull", 1000 * median_seconds(w.pull, 200))
