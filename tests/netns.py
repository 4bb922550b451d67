"""Test hosts in Linux network namespaces: one per service, joined by veth pairs to a bridge,
with an /etc/hosts in each (``ip netns exec`` mounts /etc/netns/NAME/hosts) so service
names resolve to the namespaces' addresses, as on a compose network. Needs root and iproute2.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); CI runs the tests as root"
    if shutil.which("ip") is None:
        return "iproute2 is not installed (make installs it as root)"
    probe = f"psprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Network:
    """A bridge and one namespace per host name, on 10.213.0.0/24."""

    def __init__(self, hosts: list[str]):
        tag = os.getpid() % 100000
        self.bridge = f"psbr{tag}"
        self.ns = {h: f"ps{tag}-{h}" for h in hosts}
        self.addr = {h: f"10.213.0.{i + 1}" for i, h in enumerate(hosts)}
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._forward = False
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            # A Docker engine (the image test starts one) sets iptables' FORWARD policy to
            # DROP, and with br_netfilter that drops traffic across this bridge too: let it
            # through, and take the rule out again in close().
            self._forward = self._iptables("-I") == 0
            hosts_file = "127.0.0.1 localhost\n" + "".join(f"{self.addr[h]} {h}\n" for h in hosts)
            for i, (host, ns) in enumerate(self.ns.items()):
                _ip("netns", "add", ns)
                self._made.append(ns)
                outside, inside = f"psv{tag}x{i}", f"psv{tag}y{i}"
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", inside, "netns", ns)
                _ip("link", "set", outside, "master", self.bridge)
                _ip("link", "set", outside, "up")
                _ip("-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", inside)
                _ip("-n", ns, "link", "set", inside, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts_file)
        except BaseException:
            self.close()
            raise

    def run(self, host: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace, output to ``log``."""
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[host], *argv],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def call(self, host: str, argv: list[str], env: dict[str, str], timeout: float):
        return subprocess.run(
            ["ip", "netns", "exec", self.ns[host], *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        if self._forward:
            self._iptables("-D")
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def _iptables(self, action: str) -> int:
        """Insert (-I) or delete (-D) the rule that accepts traffic across the bridge."""
        if shutil.which("iptables") is None:
            return 1
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        return subprocess.run(["iptables", action, *rule], capture_output=True).returncode
