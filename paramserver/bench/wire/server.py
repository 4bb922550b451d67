"""How many pushes one server shard absorbs, against what its memory allows.

Load generators (``pusher.py``: a Worker each, in its own process, pushing one prepared
gradient over and over with no model compute) push to a server of a one-tensor model of 1,
64 or 256 MiB under ``async``, with SGD and with Adam, through a shared segment (same host)
and through the data port (the network channel, on loopback); then to two shards, and to
one shard with ``--coalesce on``.
Pushes/s come from the server's own counter (``pushes_applied``) over a window once every
pusher runs. The pushers never pull, so no apply copies the version it replaces for pulls
(``server/engine/dense_apply.py``; with workers that pull, one more read and write of the model a
push). Two shards: through shared memory, at 64 MiB only. ``--quick`` runs each path once at
16 MiB (``Plan``): SGD and Adam through shared memory, SGD over the data port, two shards
and ``--coalesce`` with Adam.

The bound, measured in the same run: the in-place pass an apply cannot avoid, on tensors
of the same size with one torch thread (the server's default ``--server-threads``): SGD
``param.add_(grad, alpha=-lr)`` (reads the gradient and the parameters, writes the
parameters) and torch's fused Adam step (reads the gradient, reads and writes the
parameters and both moments). ``apply_vs_bound`` is the gradient bytes a shard applies a
second over the bytes that pass covers a second. (The servers run on every usable core,
``--server-threads``' default: the bound is one thread's, so at Adam the ratio may pass 1;
the two shards get half the cores each, as launch gives them.)

The server's threads (``apply_threads``): its apply of an 80 MB gradient (20M float32),
the finiteness check then ``ParameterStore.apply``'s fused Adam step, in-process with 1
and with 2 threads (``--server-threads``), their runs interleaved;
``adam_apply_80mb_threads2_vs_1`` is the speed-up (target 1.5 on the 2-core machine).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paramserver._proto import paramserver_pb2 as pb
from paramserver.bench.common import STALLED_WINDOW_S, median_seconds, server_process
from paramserver.bench.ddp import start_rank
from paramserver.bench.wire.transport import MIB, Blob
from paramserver.cluster.procs import _PARENT_ENV
from paramserver.codec.layout import Manifest
from paramserver.config import OptimizerConfig, ServerConfig
from paramserver.config.cores import host_cores, server_threads
from paramserver.server.bookkeeping.store import ParameterStore, build_optimizer
from paramserver.server.engine.checks import all_finite
from paramserver.transport import pieces
from paramserver.transport.stub import Stub, connect

PUSHERS = 2
APPLY_ELEMENTS = 20_000_000  # the gradient: 80 MB of float32
APPLY_THREADS = (1, 2)
COALESCE_PUSHERS = 4  # more pushers than cores: pushes arrive during applies


def blob_1mib() -> Blob:
    return Blob(1 * MIB)


def blob_16mib() -> Blob:
    return Blob(16 * MIB)


def blob_64mib() -> Blob:
    return Blob(64 * MIB)


def blob_256mib() -> Blob:
    return Blob(256 * MIB)


def bound_gbps(nbytes: int, optimizer: str, reps: int) -> float:
    """GB/s of gradient the bare in-place step covers: torch's own kernel for ``optimizer``
    on a flat float32 tensor of ``nbytes``, one thread, no I/O, no checks, no Python around
    it but the optimizer's ``step``; the fastest of ``reps`` (what the memory allows)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        param = torch.nn.Parameter(torch.zeros(nbytes // 4))
        param.grad = torch.full_like(param, 1e-3)
        opt = build_optimizer([param], OptimizerConfig(optimizer, lr=1e-9))
        opt.step()  # the moments' first touch
        seconds = min(median_seconds(opt.step, 1, warmup=0) for _ in range(reps))
    finally:
        torch.set_num_threads(threads)
    return nbytes / seconds / 1e9


def apply_seconds(threads: tuple[int, ...], reps: int) -> dict[int, tuple[float, float]]:
    """Median seconds of a server's apply of an ``APPLY_ELEMENTS`` float32 gradient with
    each number of ``threads`` (torch's and the check's): ``all_finite`` then
    ``ParameterStore.apply`` with Adam, as a push that the server checks itself takes; and
    of a copy of the same bytes (``copy_``: what the memory allows that many threads). The
    counts take turns, a step each (after an untimed one at that count), so a drift of the
    machine falls on all alike."""
    before = torch.get_num_threads(), pieces.threads()
    weights = np.zeros(APPLY_ELEMENTS, np.float32)
    manifest = Manifest.from_tensors([("w", torch.from_numpy(weights))])
    store = ParameterStore(manifest, weights, OptimizerConfig("adam", lr=1e-9))
    grad = np.full(APPLY_ELEMENTS, 1e-3, np.float32)
    into = torch.empty(APPLY_ELEMENTS)
    times: dict[int, list[tuple[float, float]]] = {n: [] for n in threads}

    def apply() -> None:
        if not all_finite(grad):
            raise RuntimeError("the bench's gradient is finite")
        store.apply(grad)

    def copy() -> None:
        into.copy_(torch.from_numpy(grad))

    try:
        apply()  # the moments' first touch
        copy()
        for _ in range(reps):
            for n in threads:
                torch.set_num_threads(n)
                pieces.set_threads(n)
                apply()
                step = median_seconds(apply, 1, warmup=0)
                times[n].append((step, median_seconds(copy, 1, warmup=1)))
    finally:
        torch.set_num_threads(before[0])
        pieces.set_threads(before[1])
    middle = reps // 2
    return {
        n: (sorted(a for a, _ in t)[middle], sorted(c for _, c in t)[middle])
        for n, t in times.items()
    }


def apply_threads(figures: dict[str, Any], rows: list[tuple[str, str]], reps: int) -> None:
    """``apply_seconds`` with 1 and 2 threads, and their ratio. GB/s: the bytes an apply
    moves (the check reads the gradient; Adam's step reads it, the parameters and both
    moments, and writes the last three: 8 passes over 80 MB), and a copy's two."""
    seconds = apply_seconds(APPLY_THREADS, reps)
    nbytes = APPLY_ELEMENTS * 4
    for n, (step, copy) in seconds.items():
        figures[f"adam_apply_80mb_threads{n}_ms"] = step * 1e3
        figures[f"adam_apply_80mb_threads{n}_moved_gbps"] = 8 * nbytes / step / 1e9
        figures[f"copy_80mb_threads{n}_gbps"] = 2 * nbytes / copy / 1e9
    ratio = seconds[1][0] / seconds[2][0]
    figures["adam_apply_80mb_threads2_vs_1"] = ratio
    figures["copy_80mb_threads2_vs_1"] = seconds[1][1] / seconds[2][1]
    figures["target_adam_apply_80mb_threads2_vs_1"] = 1.5
    figures["usable_cores"] = host_cores()[0]
    for n, (step, _) in seconds.items():
        rows.append(
            (
                f"adam apply, 80 MB, {n} thread{'s' if n > 1 else ''} (check + fused step)",
                f"{step * 1e3:6.1f} ms  moves {figures[f'adam_apply_80mb_threads{n}_moved_gbps']:5.1f}"
                f" GB/s  (a copy: {figures[f'copy_80mb_threads{n}_gbps']:5.1f} GB/s)",
            )
        )
    rows.append(
        (
            "adam apply, 80 MB, threads2_vs_1",
            f"{ratio:.2f} (target 1.5; a copy's {figures['copy_80mb_threads2_vs_1']:.2f}; "
            f"usable cores {figures['usable_cores']})",
        )
    )


def pushes_per_second(
    cfg: ServerConfig,
    shards: int,
    nbytes: int,
    shm: bool,
    warmup: float,
    window: float,
    logs: Path,
    pushers_n: int = PUSHERS,
    coalesced: list[float] | None = None,
) -> float:
    """Pushes a second that ``shards`` shards of ``cfg`` apply (the slowest shard's: every
    push reaches each) while ``pushers_n`` pushers push to them, shared memory or not;
    ``coalesced`` gets the share of shard 0's pushes applied with others in the window."""
    with ExitStack() as stack:
        addresses = [
            stack.enter_context(server_process(dataclasses.replace(cfg, shard=i, shards=shards)))
            for i in range(shards)
        ]
        channel = connect(addresses[0], 60)
        stack.callback(channel.close)
        pushers = []
        try:
            for i in range(pushers_n):
                argv = [",".join(addresses), str(nbytes), "on" if shm else "off", f"p{i}"]
                env = {_PARENT_ENV: str(os.getpid()), "PARAMSERVER_CONFIG": ""}
                log = logs / f"pusher-{nbytes // MIB}-{i}.log"
                pushers.append(
                    (start_rank("paramserver.bench.wire.pusher", argv, log, env=env), log)
                )
            stubs = [Stub(channel)] + [
                Stub(stack.enter_context(closing(connect(a, 60)))) for a in addresses[1:]
            ]
            _wait_until_all_push(stubs[0], pushers)
            time.sleep(warmup)
            t1, before = time.perf_counter(), [_status(s) for s in stubs]
            time.sleep(window)
            t2, after = time.perf_counter(), [_status(s) for s in stubs]
            while _none_applied(before, after) and t2 - t1 < STALLED_WINDOW_S:  # a loaded host
                time.sleep(0.25)
                t2, after = time.perf_counter(), [_status(s) for s in stubs]
        finally:
            for p, _ in pushers:
                p.kill()
                p.wait()
    applied = [b.pushes_applied - a.pushes_applied for a, b in zip(before, after, strict=True)]
    if coalesced is not None:
        together = after[0].pushes_coalesced - before[0].pushes_coalesced
        coalesced.append(together / max(applied[0], 1))
    return min(applied) / (t2 - t1)


def _none_applied(before: list[pb.StatusResponse], after: list[pb.StatusResponse]) -> bool:
    """Whether some shard applied no push between the two looks."""
    return any(b.pushes_applied == a.pushes_applied for a, b in zip(before, after, strict=True))


def _status(stub: Stub) -> pb.StatusResponse:
    return stub.Status(pb.StatusRequest(), timeout=30)


def _wait_until_all_push(stub: Stub, pushers: list[tuple[Any, Path]]) -> None:
    """Until every pusher has joined and pushes are being applied (120 s at most)."""
    deadline = time.monotonic() + 120
    while True:
        status = stub.Status(pb.StatusRequest(), timeout=30)
        if len(status.workers) == len(pushers) and status.pushes_applied > len(pushers):
            return
        for p, log in pushers:
            if p.poll() is not None:
                raise RuntimeError(f"a pusher exited: {log.read_text(errors='replace')[-800:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pushers did not all start: {status.workers}")
        time.sleep(0.1)


OPTIMIZERS = ("sgd", "adam")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The runs of one bench: ``singles`` (size MiB, optimizer, through shared memory) on
    one shard, then two shards and ``--coalesce`` on ``size`` with ``pair`` optimizers.
    The quick run keeps each path once (shared memory with either optimizer, the data
    port, two shards, coalescing on and off) instead of their cross product: each run
    costs a server and its pushers, processes that start torch."""

    sizes: tuple[int, ...]
    singles: tuple[tuple[int, str, bool], ...]
    size: int
    pair: tuple[str, ...]
    warmup: float
    window: float
    bound_reps: int
    apply_reps: int

    @classmethod
    def of(cls, quick: bool) -> Plan:
        if quick:
            quick_runs = ((16, "sgd", True), (16, "adam", True), (16, "sgd", False))
            return cls((16,), quick_runs, 16, ("adam",), 0.5, 1.5, 5, 7)
        sizes = (1, 64, 256)
        singles = tuple((s, o, shm) for s in sizes for o in OPTIMIZERS for shm in (True, False))
        return cls(sizes, singles, 64, OPTIMIZERS, 1.0, 4.0, 20, 21)


def run(quick: bool) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    plan = Plan.of(quick)
    warmup, window = plan.warmup, plan.window
    figures: dict[str, Any] = {
        "pushers": PUSHERS,
        "window_s": window,
        "sizes_mib": list(plan.sizes),
    }
    rows: list[tuple[str, str]] = [
        ("load", f"{PUSHERS} pusher processes, async, window {window:g} s after {warmup:g} s"),
    ]
    apply_threads(figures, rows, plan.apply_reps)
    with tempfile.TemporaryDirectory(prefix="paramserver-bench-server-") as tmp:
        logs = Path(tmp)
        for size in plan.sizes:
            for optimizer in OPTIMIZERS:
                bound = bound_gbps(size * MIB, optimizer, plan.bound_reps)
                figures[f"{optimizer}_{size}mib_bound_gbps"] = bound
        for size, optimizer, shm in plan.singles:
            key = f"{optimizer}_{size}mib"
            cfg = _config(size, optimizer)
            rate = pushes_per_second(cfg, 1, size * MIB, shm, warmup, window, logs)
            bound = figures[f"{key}_bound_gbps"]
            _record(
                figures,
                rows,
                key if shm else f"{key}_net",
                rate,
                size * MIB,
                bound,
                "shm" if shm else "net",
            )
        # Two shards, each a process holding half the model, on the middle size.
        size = plan.size
        half = server_threads(None, 2, *host_cores())[0]  # as launch gives two shards
        for optimizer in plan.pair:
            key = f"{optimizer}_{size}mib"
            cfg = dataclasses.replace(_config(size, optimizer), threads=half)
            rate = pushes_per_second(cfg, 2, size * MIB, True, warmup, window, logs)
            bound = figures[f"{key}_bound_gbps"]
            _record(figures, rows, f"{key}_2shards", rate, size * MIB, bound, "shm, 2 shards")
            figures[f"{key}_two_shards_vs_one"] = rate / figures[f"{key}_pushes_per_s"]
        figures["two_shards_vs_one"] = figures[f"adam_{size}mib_two_shards_vs_one"]
        figures["target_apply_vs_bound"] = 0.5  # at 64 MiB, both optimizers
        _coalesced(figures, rows, plan, logs)
    return rows, figures


def _coalesced(
    figures: dict[str, Any], rows: list[tuple[str, str]], plan: Plan, logs: Path
) -> None:
    """One shard with ``--coalesce on`` (pushes that arrive during an apply summed into
    one step) against off, ``COALESCE_PUSHERS`` pushers through shared memory
    (``coalesce_vs_off``; ``coalesced_share``: the pushes applied with others)."""
    size = plan.size
    for optimizer in plan.pair:
        key = f"{optimizer}_{size}mib"
        bound = figures[f"{key}_bound_gbps"]
        rates = {}
        for coalesce in ("off", "on"):
            cfg = dataclasses.replace(_config(size, optimizer), coalesce=coalesce)
            cfg = dataclasses.replace(cfg, workers=COALESCE_PUSHERS)
            share: list[float] = []
            rates[coalesce] = pushes_per_second(
                cfg, 1, size * MIB, True, plan.warmup, plan.window, logs, COALESCE_PUSHERS, share
            )
            name = f"{key}_{COALESCE_PUSHERS}p" + ("_coalesce" if coalesce == "on" else "")
            channel = f"shm, {COALESCE_PUSHERS} pushers, --coalesce {coalesce}"
            _record(figures, rows, name, rates[coalesce], size * MIB, bound, channel)
            figures[f"{name}_coalesced_share"] = share[0]
        figures[f"{key}_coalesce_vs_off"] = rates["on"] / rates["off"]


def _config(size: int, optimizer: str) -> ServerConfig:
    return ServerConfig(
        model=f"paramserver.bench.wire.server:blob_{size}mib",
        optimizer=OptimizerConfig(optimizer, lr=1e-9),
        policy="async",
        workers=PUSHERS,
        dataset="synthetic",
        epochs=1_000_000,
        lease_seconds=60,
    )


def _record(
    figures: dict[str, Any],
    rows: list[tuple[str, str]],
    name: str,
    rate: float,
    nbytes: int,
    bound: float,
    channel: str,
) -> None:
    applied = rate * nbytes / 1e9
    figures[f"{name}_pushes_per_s"] = rate
    figures[f"{name}_applied_gbps"] = applied
    figures[f"{name}_apply_vs_bound"] = applied / bound
    rows.append(
        (
            f"{name} ({channel})",
            f"{rate:8.1f} pushes/s  {applied:6.2f} GB/s applied  bound {bound:6.2f} GB/s  "
            f"apply_vs_bound {applied / bound:.2f}",
        )
    )
