"""The candidates for the same-host control path, measured: a round trip between two
processes (one wakes the other, which wakes it back) through a gRPC unary call, a Unix
socket carrying a fixed-size record, a pipe, an eventfd pair, a POSIX semaphore pair and a
futex in shared memory. Reports the median round trip and the CPU both sides spend on it.
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

RECORD = 64  # bytes: what a control record needs (ids, iteration, slot, counters)
SYS_FUTEX = 202  # x86_64 and, as 98, aarch64
FUTEX_WAIT, FUTEX_WAKE = 0, 1

# Each candidate: make() -> (ping, pong), run in the parent and the child after fork.
# ping() wakes the other side and waits for its answer; pong() waits, then answers.
Pair = tuple[Callable[[], None], Callable[[], None]]


def _socket_pair() -> Pair:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    record, buf = bytes(RECORD), bytearray(RECORD)

    def ping() -> None:
        a.sendall(record)
        a.recv_into(buf, RECORD, socket.MSG_WAITALL)

    def pong() -> None:
        b.recv_into(buf, RECORD, socket.MSG_WAITALL)
        b.sendall(record)

    return ping, pong


def _pipe_pair() -> Pair:
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    record = bytes(RECORD)

    def ping() -> None:
        os.write(w1, record)
        os.read(r2, RECORD)

    def pong() -> None:
        os.read(r1, RECORD)
        os.write(w2, record)

    return ping, pong


def _eventfd_pair() -> Pair:
    there, back = os.eventfd(0), os.eventfd(0)

    def ping() -> None:
        os.eventfd_write(there, 1)
        os.eventfd_read(back)

    def pong() -> None:
        os.eventfd_read(there)
        os.eventfd_write(back, 1)

    return ping, pong


def _semaphore_pair() -> Pair:
    there, back = mp.get_context("fork").Semaphore(0), mp.get_context("fork").Semaphore(0)

    def ping() -> None:
        there.release()
        back.acquire()

    def pong() -> None:
        there.acquire()
        back.release()

    return ping, pong


def _futex_pair() -> Pair:
    libc = ctypes.CDLL(None, use_errno=True)
    shared = mmap.mmap(-1, 128)  # anonymous and shared: the child maps the same page
    there = ctypes.c_int.from_buffer(shared, 0)
    back = ctypes.c_int.from_buffer(shared, 64)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long

    def signal(word: ctypes.c_int) -> None:
        word.value += 1  # one writer per word; an aligned int store is atomic on x86
        syscall(SYS_FUTEX, ctypes.byref(word), FUTEX_WAKE, 1, None, None, 0)

    def wait(word: ctypes.c_int, seen: int) -> None:
        while word.value == seen:
            syscall(SYS_FUTEX, ctypes.byref(word), FUTEX_WAIT, seen, None, None, 0)

    def ping() -> None:
        seen = back.value
        signal(there)
        wait(back, seen)

    state = {"there": 0}

    def pong() -> None:
        wait(there, state["there"])
        state["there"] = there.value
        signal(back)

    return ping, pong


def _grpc_pair() -> Pair:
    """A unary call of a 64-byte message to a server in the child (the control path today)."""
    import grpc

    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{port.getsockname()[1]}"
    port.close()
    state: dict[str, Any] = {}
    record = bytes(RECORD)

    def ping() -> None:
        if "call" not in state:
            channel = grpc.insecure_channel(address)
            grpc.channel_ready_future(channel).result(timeout=30)
            state["call"] = channel.unary_unary("/bench.Echo/Echo")
        state["call"](record, timeout=30)

    def pong() -> None:
        handler = grpc.method_handlers_generic_handler(
            "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: r)}
        )
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(address)
        server.start()
        server.wait_for_termination()

    return ping, pong


CANDIDATES: dict[str, Callable[[], Pair]] = {
    "grpc_unary": _grpc_pair,
    "unix_socket": _socket_pair,
    "pipe": _pipe_pair,
    "eventfd": _eventfd_pair,
    "posix_semaphore": _semaphore_pair,
    "futex": _futex_pair,
}


def _serve(pong: Callable[[], None], grpc_server: bool) -> None:
    if grpc_server:
        pong()
    while True:
        pong()


def round_trip(name: str, reps: int) -> tuple[float, float]:
    """The median round trip (s) through ``name`` and the parent's CPU seconds per trip."""
    ping, pong = CANDIDATES[name]()
    child = mp.get_context("fork").Process(
        target=_serve, args=(pong, name == "grpc_unary"), daemon=True
    )
    child.start()
    try:
        for _ in range(max(reps // 10, 20)):
            ping()
        times = []
        cpu = time.process_time()
        for _ in range(reps):
            started = time.perf_counter()
            ping()
            times.append(time.perf_counter() - started)
        cpu = (time.process_time() - cpu) / reps
    finally:
        child.kill()
        child.join(30)
    times.sort()
    return times[len(times) // 2], cpu


def run(quick: bool) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    reps = 300 if quick else 5000
    figures: dict[str, Any] = {"reps": reps, "record_bytes": RECORD}
    rows = [("round trip", f"one process wakes another and waits for it; median of {reps}")]
    for name in CANDIDATES:
        latency, cpu = round_trip(name, reps)
        figures[f"{name}_us"] = 1e6 * latency
        figures[f"{name}_cpu_us"] = 1e6 * cpu
        rows.append((name, f"{1e6 * latency:7.1f} us round trip, {1e6 * cpu:6.1f} us CPU (caller)"))
    return rows, figures
