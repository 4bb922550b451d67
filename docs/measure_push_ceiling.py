"""What limits ``bench transport``'s ``push_remote_vs_tcp`` on this 2-core machine: raw
loopback TCP (64 MiB messages on one connection, ``sendall`` into ``recv_into``) alone, and
the same with the receiver doing a server's work on each message on a thread of its own,
behind the next receive (as the data port does): the finiteness check, the copy of the
version the apply replaces, and the fused SGD step on 64 MiB. Then a Worker's push over
the data port to a real server (``bench transport``'s ``push_remote``), in the same run.
Medians of 10 messages after 3; three rounds, alternating.

If the push is close to "TCP with the server's work", the channel is not what is slow:
the cores are, which the send, the receive and the apply share.

Run: .venv/bin/python docs/measure_push_ceiling.py
"""

import concurrent.futures
import logging
import socket
import statistics
import threading
import time

import numpy as np
import torch

from paramserver.bench.common import server_process
from paramserver.bench.wire.transport import MIB, worker_gbps
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.server.engine.checks import all_finite

NBYTES, REPS, WARMUP = 64 * MIB, 10, 3
torch.set_num_threads(1)


def tcp_gbps(work: bool) -> float:
    """GB/s of 64 MiB messages over one loopback connection; with ``work``, each received
    message is checked, snapshot and stepped on (fused SGD) behind the next receive."""
    n = WARMUP + REPS
    payload = np.full(NBYTES // 4, 1e-3, np.float32).data  # a gradient's values (ones as
    # bytes would be denormal floats, which the step takes 7 x as long on)
    buffers = [np.empty(NBYTES // 4, np.float32) for _ in range(2)]
    param = torch.nn.Parameter(torch.zeros(NBYTES // 4))
    opt = torch.optim.SGD([param], lr=1e-9, fused=True)
    snap = np.empty(NBYTES // 4, np.float32)
    applier = concurrent.futures.ThreadPoolExecutor(1)

    def apply(buf: np.ndarray) -> None:
        if not all_finite(buf):
            raise ValueError("not finite")
        np.copyto(snap, param.detach().numpy())
        param.grad = torch.from_numpy(buf)
        opt.step()

    listener = socket.create_server(("127.0.0.1", 0))
    arrived: list[float] = []

    def receive() -> None:
        conn, _ = listener.accept()
        pending: concurrent.futures.Future[None] | None = None
        for i in range(n):
            view, got = memoryview(buffers[i % 2]).cast("B"), 0
            while got < NBYTES:
                k = conn.recv_into(view[got:], NBYTES - got)
                if k == 0:
                    raise ConnectionError("sender closed early")
                got += k
            if work:
                if pending is not None:
                    pending.result()  # the buffer the next receive fills is free again
                pending = applier.submit(apply, buffers[i % 2])
            conn.sendall(b"k")  # the message is in: the sender's push is answered
            arrived.append(time.perf_counter())
        if pending is not None:
            pending.result()
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    took = []
    with socket.create_connection(("127.0.0.1", listener.getsockname()[1])) as sender:
        for _ in range(n):
            t0 = time.perf_counter()
            sender.sendall(payload)
            sender.recv(1)
            took.append(time.perf_counter() - t0)
    thread.join()
    listener.close()
    applier.shutdown()
    return NBYTES / statistics.median(took[WARMUP:]) / 1e9


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    cfg = ServerConfig(
        model="paramserver.bench.wire.transport:blob_64mib",
        optimizer=OptimizerConfig("sgd", lr=1e-9),
        policy="async",
        workers=1,
        lease_seconds=600,
    )
    rows: dict[str, list[float]] = {"tcp": [], "tcp_with_work": [], "push_remote": []}
    with server_process(cfg) as address:
        for _ in range(3):
            rows["tcp"].append(tcp_gbps(False))
            rows["tcp_with_work"].append(tcp_gbps(True))
            rows["push_remote"].append(worker_gbps(address, NBYTES, REPS, False, wire="auto")[0])
    for key, values in rows.items():
        print(f"{key:14s} " + "  ".join(f"{v:.3f}" for v in values) + " GB/s")
    for i in range(3):
        tcp, work, push = (rows[k][i] for k in rows)
        print(
            f"round {i + 1}: push / tcp {push / tcp:.2f}, push / tcp with the server's work "
            f"{push / work:.2f}, tcp with the work / tcp {work / tcp:.2f}"
        )


if __name__ == "__main__":
    main()
