"""The data port against the gRPC alternatives the network issue named: 64 MiB sent from one
process to another over loopback as a gRPC client stream of chunks of 1, 4 or 16 MiB, on
1, 2 or 4 parallel streams (each its share of the 64 MiB, from threads, on one channel and
on one channel each), into a preallocated buffer on the receiving side, as a server's
push would be; against raw TCP (``bench transport``'s baseline) in the same run. Medians of
5 sends after 1. It measures the bytes' path only: no optimizer, no check.

Run: .venv/bin/python docs/measure_grpc_options.py
"""

import concurrent.futures
import multiprocessing

import grpc
import numpy as np

from paramserver.bench.common import median_seconds
from paramserver.bench.wire.transport import MIB, tcp_gbps

NBYTES, REPS = 64 * MIB, 5
OPTIONS = [
    ("grpc.max_receive_message_length", 32 * MIB),
    ("grpc.max_send_message_length", 32 * MIB),
]
METHOD = "/bench.Sink/Take"


def serve(port: multiprocessing.Queue) -> None:
    """A gRPC server whose one method copies a stream's chunks into a buffer."""
    sink = np.empty(NBYTES, np.uint8)

    def take(chunks, context):  # noqa: ANN001, ARG001 - gRPC's handler signature
        got = 0
        for chunk in chunks:  # the stream's share is written from its own offset
            offset, data = int.from_bytes(chunk[:8], "little"), memoryview(chunk)[8:]
            sink[offset : offset + len(data)] = np.frombuffer(data, np.uint8)
            got += len(data)
        return got.to_bytes(8, "little")

    handler = grpc.method_handlers_generic_handler(
        "bench.Sink", {"Take": grpc.stream_unary_rpc_method_handler(take)}
    )
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(8), options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def grpc_gbps(port: int, chunk: int, streams: int, channels: int) -> float:
    """GB/s of 64 MiB as ``streams`` client streams of ``chunk``-byte messages, on
    ``channels`` channels (1, or one a stream)."""
    payload = memoryview(np.ones(NBYTES, np.uint8).data)
    made = [grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) for _ in range(channels)]
    calls = [c.stream_unary(METHOD) for c in made]
    share = NBYTES // streams
    pool = concurrent.futures.ThreadPoolExecutor(streams)

    def one(i: int) -> int:
        lo = i * share

        def chunks():
            for a in range(lo, lo + share, chunk):
                b = min(a + chunk, lo + share)
                yield a.to_bytes(8, "little") + bytes(payload[a:b])

        return int.from_bytes(calls[i % channels](chunks()), "little")

    def send() -> None:
        assert sum(pool.map(one, range(streams))) == NBYTES

    seconds = median_seconds(send, REPS, warmup=1)
    pool.shutdown()
    for c in made:
        c.close()
    return NBYTES / seconds / 1e9


def main() -> None:
    ports: multiprocessing.Queue = multiprocessing.Queue()
    child = multiprocessing.Process(target=serve, args=(ports,), daemon=True)
    child.start()
    try:
        port = ports.get(timeout=30)
        tcp = tcp_gbps(NBYTES, REPS)
        print(f"raw TCP {tcp:.2f} GB/s")
        for chunk in (1 * MIB, 4 * MIB, 16 * MIB):
            for streams in (1, 2, 4):
                for channels in sorted({1, streams}):
                    gbps = grpc_gbps(port, chunk, streams, channels)
                    print(
                        f"gRPC, {chunk // MIB:2d} MiB messages, {streams} stream(s) on "
                        f"{channels} channel(s): {gbps:.2f} GB/s, {gbps / tcp:.2f} x TCP"
                    )
    finally:
        child.kill()
        child.join()


if __name__ == "__main__":
    main()
