"""Push and pull of a large model through a real server, against raw TCP and memcpy."""

from __future__ import annotations

import socket
import threading
from typing import Any

import numpy as np
import torch
from torch import nn

from paramserver import codec
from paramserver._proto import paramserver_pb2 as pb
from paramserver.bench.common import median_seconds, server_process
from paramserver.worker.client import Worker

MIB = 1 << 20


class Blob(nn.Module):
    """One flat parameter of ``nbytes`` bytes: a model that is all payload."""

    def __init__(self, nbytes: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(nbytes // 4))


def blob_64mib() -> nn.Module:
    return Blob(64 * MIB)


def blob_16mib() -> nn.Module:
    return Blob(16 * MIB)


def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return nbytes / median_seconds(lambda: np.copyto(dst, src), reps) / 1e9


def tcp_gbps(nbytes: int, reps: int) -> float:
    """One-way loopback TCP with Python sockets: sendall into recv_into, a new connection each."""
    payload = np.ones(nbytes, np.uint8).data
    sink = bytearray(nbytes)

    def once() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]

        def receive() -> None:
            conn, _ = listener.accept()
            view, got = memoryview(sink), 0
            while got < nbytes:
                n = conn.recv_into(view[got:], nbytes - got)
                if n == 0:
                    raise ConnectionError("sender closed early")
                got += n
            conn.close()

        thread = threading.Thread(target=receive)
        thread.start()
        with socket.create_connection(("127.0.0.1", port)) as sender:
            sender.sendall(payload)
        thread.join()
        listener.close()

    return nbytes / median_seconds(once, reps) / 1e9


def run(quick: bool) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    nbytes = (16 if quick else 64) * MIB
    reps = 3 if quick else 10
    model = "blob_16mib" if quick else "blob_64mib"
    figures: dict[str, Any] = {"payload_mib": nbytes // MIB, "reps": reps}
    figures["memcpy_gbps"] = memcpy_gbps(nbytes, reps)
    figures["tcp_gbps"] = tcp_gbps(nbytes, reps)
    server_args = ("--model", f"paramserver.bench.transport:{model}", "--optimizer", "sgd",
                   "--lr", "1e-9", "--policy", "async", "--workers", "1",
                   "--lease-timeout", "600")  # fmt: skip
    with server_process(*server_args) as address:
        worker = Worker(address, Blob(nbytes))
        try:
            grad = codec.as_bytes(np.full(nbytes // 4, 1e-3, np.float32))

            def push() -> None:
                header = pb.PushHeader(
                    worker_id=worker.worker_id, iteration=worker.clock, samples=1,
                    incarnation=worker.incarnation,
                )  # fmt: skip
                worker._stub.Push(codec.encode_push(header, grad, worker.chunk_bytes), timeout=60)
                worker.clock += 1

            figures["push_gbps"] = nbytes / median_seconds(push, reps) / 1e9
            figures["pull_gbps"] = nbytes / median_seconds(worker.pull, reps) / 1e9
        finally:
            worker.close_quietly()
    figures["push_vs_tcp"] = figures["push_gbps"] / figures["tcp_gbps"]
    figures["pull_vs_tcp"] = figures["pull_gbps"] / figures["tcp_gbps"]
    figures["target_push_vs_tcp"] = 0.6
    figures["target_met"] = figures["push_vs_tcp"] >= 0.6
    rows = [
        ("payload", f"{nbytes // MIB} MiB, median of {reps}"),
        ("memcpy", f"{figures['memcpy_gbps']:.2f} GB/s"),
        ("raw TCP loopback", f"{figures['tcp_gbps']:.2f} GB/s"),
        ("push (gRPC, server applies SGD)", f"{figures['push_gbps']:.2f} GB/s  ({figures['push_vs_tcp']:.2f} x TCP; target 0.6)"),
        ("pull (gRPC)", f"{figures['pull_gbps']:.2f} GB/s  ({figures['pull_vs_tcp']:.2f} x TCP)"),
    ]  # fmt: skip
    return rows, figures
