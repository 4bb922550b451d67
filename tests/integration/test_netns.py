"""The namespace network the network bench and the deploy test build: shaped links, and
nothing left behind, also when the body fails."""

from __future__ import annotations

import os
import sys
import time

import pytest

from paramserver.cluster import netns
from paramserver.errors import ConfigError

# Network namespaces on one fixed subnet, counted machine-wide: one such test at a time
# under `make test`'s processes (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("netns")


def test_rates_in_tcs_units() -> None:
    assert netns.rate_bits("100mbit") == 100e6
    assert netns.rate_bits("1gbit") == 1e9
    assert netns.rate_bits("10GBIT") == 10e9
    for bad in ("fast", "1gb", "-1gbit", "0mbit", ""):
        with pytest.raises(ConfigError, match="--rate"):
            netns.rate_bits(bad)


needs_namespaces = pytest.mark.skipif(
    netns.unavailable() is not None, reason=str(netns.unavailable())
)

RECEIVE = """
import socket, sys
listener = socket.create_server((sys.argv[1], 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
got = 0
while True:
    data = conn.recv(1 << 20)
    if not data:
        break
    got += len(data)
conn.sendall(str(got).encode())
"""


@needs_namespaces
def test_a_shaped_link_carries_no_more_than_its_rate_and_is_removed(tmp_path) -> None:
    with netns.Network(["a", "b"], "100mbit") as net:
        tag = net.tag
        qdiscs = net.call("a", ["tc", "qdisc", "show"], dict(os.environ), timeout=30).stdout
        assert "tbf" in qdiscs and "100Mbit" in qdiscs
        log = tmp_path / "recv.log"
        net.run("b", [sys.executable, "-c", RECEIVE, net.addr["b"]], dict(os.environ), log)
        deadline = time.monotonic() + 30
        while not log.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.02)
        port = int(log.read_text().split()[0])
        nbytes = 2_500_000  # 0.2 s at the rate
        send = (
            "import socket, sys, time\n"
            "c = socket.create_connection((sys.argv[1], int(sys.argv[2])))\n"
            "t = time.perf_counter(); c.sendall(bytes(int(sys.argv[3]))); c.shutdown(1)\n"
            "got = c.recv(64); print(time.perf_counter() - t, got.decode())\n"
        )
        argv = [sys.executable, "-c", send, net.addr["b"], str(port), str(nbytes)]
        done = net.call("a", argv, dict(os.environ), timeout=60)
        assert done.returncode == 0, done.stderr
        seconds, got = done.stdout.split()
        assert int(got) == nbytes
        util = nbytes * 8 / float(seconds) / 100e6
        assert util < 1.15, f"{util:.2f} x the rate: the link is not shaped"
        assert util > 0.3, f"{util:.2f} x the rate: far below it"
    assert netns.leftovers(tag) == []


@needs_namespaces
def test_nothing_is_left_behind_when_the_body_fails() -> None:
    with pytest.raises(RuntimeError, match="boom"), netns.Network(["a", "b"], "1gbit") as net:
        tag = net.tag
        assert net.call("a", ["true"], dict(os.environ), timeout=30).returncode == 0
        raise RuntimeError("boom")
    assert netns.leftovers(tag) == []


@needs_namespaces
def test_the_network_bench_removes_its_namespaces_when_terminated() -> None:
    """SIGTERM in the middle of ``bench network``: it unwinds and removes what it made."""
    import signal
    import subprocess

    from tests.conftest import paramserver_popen

    bench = paramserver_popen(
        "bench",
        "network",
        "--quick",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    tag = bench.pid % 100000
    try:
        deadline = time.monotonic() + 60
        while not any(n.startswith(f"ps{tag}-") for n in _namespaces()):
            assert bench.poll() is None, bench.stderr.read() if bench.stderr else ""
            assert time.monotonic() < deadline, "the bench made no namespace within 60 s"
            time.sleep(0.02)
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
        assert "removing its namespaces" in err
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(timeout=30)
    assert netns.leftovers(tag) == []


def _namespaces() -> list[str]:
    import subprocess

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


HOLD = """
import sys, time
from paramserver.cluster import netns
with netns.Network(["a"]) as net:
    net.reach_root()
    print(net.tag, flush=True)
    time.sleep(600)
"""


def _holder():
    import subprocess

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = holder.stdout.readline() if holder.stdout else ""
    assert line.strip(), holder.stderr.read() if holder.stderr else ""
    return holder, int(line)


@needs_namespaces
def test_a_network_whose_maker_was_killed_is_removed_by_the_next_one() -> None:
    """The CI failure of stop 65: a soak killed by the test's timeout left its bridge holding
    the root address, and the next soak's workers waited four minutes for servers whose
    replies went to the dead bridge. Now the next network removes it, and reaches the root."""
    import signal
    import socket

    holder, tag = _holder()
    try:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert netns.leftovers(tag), "a network killed with -9 left nothing to remove?"
        with netns.Network(["b"]) as net:
            assert netns.leftovers(tag) == []
            root = net.reach_root()
            server = socket.create_server((root, 0))
            port = server.getsockname()[1]
            code = f"import socket; socket.create_connection(('{root}', {port}), timeout=5)"
            done = net.call("b", [sys.executable, "-c", code], dict(os.environ), timeout=30)
            server.close()
            assert done.returncode == 0, done.stderr
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
        netns.sweep()


@needs_namespaces
def test_a_running_network_keeps_the_root_address_and_sigterm_removes_it() -> None:
    """A second run's ``reach_root`` while the first one's network lives: a clear error,
    not a stolen route; the first, sent SIGTERM, removes its network as it ends."""
    import signal

    holder, tag = _holder()
    try:
        with netns.Network(["b"]) as net:
            assert netns.sweep() == []  # its maker is alive: kept
            with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
                net.reach_root()
        holder.send_signal(signal.SIGTERM)
        _, err = holder.communicate(timeout=60)
        assert "removing the network namespaces" in err
        assert netns.leftovers(tag) == []
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
        netns.sweep()
