"""Across a shaped link: a server and a worker on two hosts (Linux network namespaces joined
by veth pairs, each link shaped with ``tc tbf`` in both directions), measured side by side
with raw TCP between the same two hosts. This kernel has ``tbf`` but no ``netem``: the links
have a rate and no added delay or loss, and the report says so.

Figures per rate R (``100mbit``, ``1gbit``, ``10gbit``; ``--quick``: 1gbit): raw TCP's
bytes/s and the worker's push and pull over the server's data port (``remote``, what a
worker on another host takes by default) and over gRPC streams (``--wire grpc``), each as
GB/s, as a share of the link (bytes/s x 8 / rate: ``*_link_util_R``) and against raw TCP
(``*_vs_tcp_R``). The data port's at 1 Gbit/s are also ``push_link_util`` and
``pull_link_util``, and its push at 10 Gbit/s against raw TCP's ``push_link_vs_tcp_10g``
(this machine's CPU caps raw Python TCP below 10 Gbit/s). Then training at the slowest
rate: DDP against every variant (``network_training.VARIANTS``; ``--quick``: all but
``topk_2shards``, ``local32`` and ``local32_int8_overlap``, whose paths the others run).

The processes inside the namespaces run this module (``probe``): ``tcp-recv`` and
``tcp-send`` time raw TCP, ``push`` times a Worker against the server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from paramserver.bench.wire import network_training
from paramserver.cluster import netns
from paramserver.cluster.commands import CHILD_ENV, server_args
from paramserver.cluster.procs import READY_MARKER, Forked
from paramserver.config import OptimizerConfig, ServerConfig

MIB = 1 << 20
FULL_RATES = ("100mbit", "1gbit", "10gbit")
NO_DELAY = "none: this kernel has tc tbf (rate) but no netem (delay, loss)"


def run(
    quick: bool, rates: tuple[str, ...] = (), only: str = ""
) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Link figures at each rate, then training at the slowest; ``only`` (variant names,
    comma-separated): those variants beside DDP, and no link figures."""
    why = netns.unavailable()
    if why is not None:
        raise click.ClickException(f"bench network needs network namespaces: {why}.")
    rates = rates or (("1gbit",) if quick else FULL_RATES)
    for rate in rates:
        netns.rate_bits(rate)  # a bad one fails before anything is made
    variants = network_training.chosen(only)
    if quick and not only:  # their paths run in the others' (topk's and fp32_2shards',
        for name in ("topk_2shards", "local32", "local32_int8_overlap"):  # int8's, overlap's)
            variants.pop(name)
    # SIGTERM (a job's timeout, kill) unwinds like Ctrl-C, so every namespace is removed
    signal.signal(signal.SIGTERM, _terminated)
    figures: dict[str, Any] = {"rates": list(rates), "delay": NO_DELAY, "reps": 3 if quick else 5}
    rows: list[tuple[str, str]] = [("link delay", NO_DELAY)]
    for rate in rates if not only else ():
        # the transport bench's models: 16 MiB (1.3 s at 100 Mbit/s) below 1 Gbit/s, else 64
        nbytes = (64 if netns.rate_bits(rate) >= 1e9 else 16) * MIB
        link = link_figures(rate, nbytes, figures["reps"])
        figures.update(link)
        rows += rows_of(rate, nbytes, link)
    if "1gbit" in rates and not only:
        figures["push_link_util"] = figures["push_remote_link_util_1gbit"]
        figures["pull_link_util"] = figures["pull_remote_link_util_1gbit"]
    if "10gbit" in rates and not only:
        figures["push_link_vs_tcp_10g"] = figures["push_remote_vs_tcp_10gbit"]
    # Training against DDP where the link is the tightest: the slowest rate of the run.
    slowest = min(rates, key=netns.rate_bits)
    train_rows, trained = network_training.run(network_training.Plan.of(slowest, quick), variants)
    figures.update(trained)
    figures["train_rate"] = slowest
    figures["only"] = sorted(variants) if only else []
    for key in list(trained):
        if key.endswith(("_samples_vs_ddp_" + slowest, "_time_to_88_vs_ddp_" + slowest)):
            figures[key.removesuffix("_" + slowest)] = trained[key]
    return rows + train_rows, figures


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(f"bench network: signal {signum}; removing its namespaces")


def link_figures(rate: str, nbytes: int, reps: int) -> dict[str, float]:
    """Raw TCP and a worker's gRPC push and pull between two hosts on links of ``rate``."""
    bits = netns.rate_bits(rate)
    env = {**os.environ, **CHILD_ENV}
    with (
        tempfile.TemporaryDirectory(prefix="paramserver-net-") as tmp,
        netns.Network(["server", "worker"], rate) as net,
    ):
        tcp = _tcp_gbps(net, env, Path(tmp), nbytes, reps)
        address = _start_server(net, env, Path(tmp), nbytes)
        out = {f"tcp_gbps_{rate}": tcp, f"tcp_link_util_{rate}": tcp * 1e9 * 8 / bits}
        for path, wire in (("remote", "auto"), ("grpc", "grpc")):
            probe = [sys.executable, "-m", "paramserver.bench.wire.network", "push", address, wire]
            done = net.call("worker", [*probe, str(nbytes), str(reps)], env, timeout=600)
            if done.returncode != 0:
                raise click.ClickException(f"the worker's probe failed: {done.stderr.strip()}")
            pushed, pulled = json.loads(done.stdout.splitlines()[-1])
            for way, gbps in (("push", pushed), ("pull", pulled)):
                out[f"{way}_{path}_gbps_{rate}"] = gbps
                out[f"{way}_{path}_link_util_{rate}"] = gbps * 1e9 * 8 / bits
                out[f"{way}_{path}_vs_tcp_{rate}"] = gbps / tcp
    return out


def _tcp_gbps(net: netns.Network, env: dict[str, str], tmp: Path, nbytes: int, reps: int) -> float:
    me = [sys.executable, "-m", "paramserver.bench.wire.network"]
    log = tmp / "tcp-recv.log"
    receiver = net.run("server", [*me, "tcp-recv", net.addr["server"], str(nbytes)], env, log)
    port = _wait_for(log, "port ", receiver, 60.0)
    done = net.call(
        "worker",
        [*me, "tcp-send", net.addr["server"], port, str(nbytes), str(reps)],
        env,
        timeout=600,
    )
    if done.returncode != 0:
        raise click.ClickException(f"raw TCP between the hosts failed: {done.stderr.strip()}")
    return float(done.stdout.strip().splitlines()[-1])


def _start_server(net: netns.Network, env: dict[str, str], tmp: Path, nbytes: int) -> str:
    model = "blob_64mib" if nbytes > 16 * MIB else "blob_16mib"
    cfg = ServerConfig(
        model=f"paramserver.bench.wire.transport:{model}",
        optimizer=OptimizerConfig("sgd", lr=1e-9),
        policy="async",
        workers=1,
        lease_seconds=600,
        host=net.addr["server"],
        port=0,
    )
    argv = [sys.executable, "-m", "paramserver", *server_args(cfg)]
    log = tmp / "server.log"
    proc = net.run("server", argv, env, log)
    return _wait_for(log, READY_MARKER + " ", proc, 120.0)


def _wait_for(log: Path, marker: str, proc: subprocess.Popen | Forked, timeout: float) -> str:
    """The word after ``marker`` in ``log``, once ``proc`` wrote it (within ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if marker in text:
            return text.split(marker, 1)[1].split()[0]
        if proc.poll() is not None:
            raise click.ClickException(f"exited with {proc.returncode} before ready: {text[-800:]}")
        time.sleep(0.05)
    raise click.ClickException(f"not ready within {timeout:.0f} s: see {log}")


def rows_of(rate: str, nbytes: int, f: dict[str, float]) -> list[tuple[str, str]]:
    def line(key: str) -> str:
        util = f[f"{key}_link_util_{rate}"]
        return f"{f[f'{key}_gbps_{rate}'] * 8:.3f} Gbit/s ({util:.2f} x the link)"

    rows = [(f"{rate}: raw TCP, {nbytes // MIB} MiB", line("tcp"))]
    for path, how in (("remote", "the data port"), ("grpc", "gRPC streams")):
        for way in ("push", "pull"):
            key = f"{way}_{path}"
            rows.append(
                (
                    f"{rate}: {way} over {how}",
                    line(key) + f", {f[f'{key}_vs_tcp_{rate}']:.2f} x TCP",
                )
            )
    return rows


# --- the probes, run inside the namespaces -------------------------------------------------


def _recv(host: str, nbytes: int) -> None:
    """Answers every connection: reads ``nbytes``, then one byte back."""
    listener = socket.create_server((host, 0))
    print(f"port {listener.getsockname()[1]}", flush=True)
    sink = bytearray(nbytes)
    while True:
        conn, _ = listener.accept()
        with conn:
            view, got = memoryview(sink), 0
            while got < nbytes:
                n = conn.recv_into(view[got:], nbytes - got)
                if n == 0:
                    raise ConnectionError("the sender closed early")
                got += n
            conn.sendall(b"k")


def _send(host: str, port: int, nbytes: int, reps: int) -> float:
    """The median GB/s of ``reps`` transfers of ``nbytes``, each until the receiver's byte."""
    payload = memoryview(bytes(nbytes))
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        with socket.create_connection((host, port), timeout=600) as conn:
            conn.sendall(payload)
            if conn.recv(1) != b"k":
                raise ConnectionError("the receiver did not acknowledge")
        times.append(time.perf_counter() - started)
    return nbytes / sorted(times)[len(times) // 2] / 1e9


def probe(argv: list[str]) -> None:
    kind, rest = argv[0], argv[1:]
    if kind == "tcp-recv":
        _recv(rest[0], int(rest[1]))
    elif kind == "tcp-send":
        print(_send(rest[0], int(rest[1]), int(rest[2]), int(rest[3])))
    elif kind == "push":  # address, wire, bytes, reps
        from paramserver.bench.wire.transport import worker_gbps

        figures = worker_gbps(rest[0], int(rest[2]), int(rest[3]), shm=False, wire=rest[1])
        print(json.dumps(figures))
    else:
        raise SystemExit(f"unknown probe {kind!r}")


if __name__ == "__main__":
    probe(sys.argv[1:])
