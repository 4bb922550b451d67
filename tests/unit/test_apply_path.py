"""The server's push path allocates nothing the size of the model once warm: a gradient is
received or widened into a receive buffer of the server's, a sync round sums into one
buffer every round reuses, the optimizer steps in place, and a pull's snapshot reuses an
earlier version's buffer. Counted with tracemalloc (numpy's buffers are traced) over 100
pushes, and with torch's profiler for tensors."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import compression
from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.server.bookkeeping.store import ParameterStore
from paramserver.server.doors.payloads import Payloads
from paramserver.server.doors.steps import Steps
from paramserver.server.engine.coordinator import Coordinator
from paramserver.transport.attachments import Attachments

N = 1 << 20  # 4 MiB of float32: any copy of the gradient or weights shows
PUSHES = 100


def _steps(policy: str, workers: int, optimizer: str) -> Steps:
    manifest = Manifest.from_tensors([("w", torch.zeros(N))])
    opt = OptimizerConfig(optimizer, lr=1e-6)
    store = ParameterStore(manifest, np.zeros(N, np.float32), opt)
    config = ServerConfig(
        policy=policy, workers=workers, optimizer=opt, dataset="synthetic", epochs=10_000
    )
    coordinator = Coordinator(config, store)
    return Steps(coordinator, Payloads(Attachments(manifest.total_bytes, manifest.dtype)))


def _payload(compress: str) -> tuple[compression.Codec, np.ndarray]:
    codec = compression.by_name(compress)(N, dense=0)
    gradient = torch.linspace(-1e-3, 1e-3, N)
    return codec, np.frombuffer(codec.encode(gradient, key=(0, 0)), np.uint8).copy()


def _header(steps: Steps, worker_id: str, iteration: int, codec: compression.Codec, nbytes: int):
    return pb.PushHeader(
        worker_id=worker_id,
        iteration=iteration,
        samples=1,
        loss=math.nan,
        incarnation=steps.c.incarnation,
        dtype=codec.dtype,
        exact=codec.exact,
        topk=codec.topk,
        scale_block=codec.block,
        total_bytes=nbytes,
    )


def _chunks(payload: np.ndarray, size: int = 1 << 18) -> list[pb.PushChunk]:
    return [
        pb.PushChunk(data=payload[i : i + size].tobytes()) for i in range(0, payload.size, size)
    ]


def _run(steps: Steps, workers: list[str], pushes: int, first: int, codec, payload, wire: str):
    """``pushes`` pushes from each worker in turn (a pull each under sync), by the data
    port's entry (the bytes received whole into a server buffer) or a gRPC stream's."""
    chunks = _chunks(payload) if wire == "stream" else []
    for it in range(first, first + pushes):
        for w in workers:
            header = _header(steps, w, it, codec, payload.nbytes)
            if wire == "stream":
                steps.push(header, iter(chunks))
            else:
                with steps.payloads.received_buffer(payload.nbytes) as buf:
                    buf[:] = payload
                    steps.push(header, iter(()), buf)
        for w in workers:
            pull = pb.PullRequest(worker_id=w, iteration=it + 1, incarnation=steps.c.incarnation)
            steps.pull(pull, 5.0, lambda: True)


@pytest.mark.parametrize(
    "policy,workers,optimizer,compress,wire",
    [
        ("async", 1, "sgd", "none", "port"),
        ("async", 1, "adam", "none", "stream"),
        ("async", 1, "momentum", "bf16", "port"),
        ("async", 1, "sgd", "fp16", "stream"),
        ("async", 1, "adam", "topk:0.01", "port"),
        ("async", 1, "sgd", "int8", "stream"),
        ("sync", 2, "adam", "int8", "port"),
        ("sync", 2, "sgd", "none", "port"),
        ("sync", 2, "adam", "bf16", "stream"),
    ],
)
def test_a_hundred_pushes_allocate_no_buffer_the_size_of_the_model(
    policy, workers, optimizer, compress, wire
):
    steps = _steps(policy, workers, optimizer)
    ids = [steps.c.join(f"w{i}").worker_id for i in range(workers)]
    codec, payload = _payload(compress)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        # warm: buffers, moments, snapshots, and what the profiler imports on its first use
        # (torch._dynamo, which no step imports any more: config/lazy_dynamo.py)
        _run(steps, ids, 3, 0, codec, payload, wire)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            _run(steps, ids, PUSHES, 3, codec, payload, wire)
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert steps.c.status().as_dict()["pushes_applied"] == (PUSHES + 3) * workers
    model_bytes = N * 4
    # numpy: a gRPC stream's chunks are bytes objects (a quarter MiB each), nothing else
    assert peak - before < model_bytes // 2, f"a push or pull allocated {peak - before} bytes"
    assert after - before < model_bytes // 8
    # torch: no operator allocates a tensor the size of the model
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert largest < model_bytes // 4, f"a torch operator allocated {largest} bytes"
