"""Hosts in Linux network namespaces: one per host name, joined by veth pairs to a bridge,
with an /etc/hosts in each (``ip netns exec`` mounts /etc/netns/NAME/hosts) so host names
resolve to the namespaces' addresses, as on a compose network. A link's rate can be shaped
with ``tc ... tbf`` in both directions (this kernel has no ``netem``: no added delay or loss).
Needs root and iproute2; ``unavailable()`` says why not.

Everything a ``Network`` makes (namespaces, veths, the bridge, /etc/netns folders, one
iptables rule) is removed by ``close()``, which ``with`` calls also when the body fails or
SIGTERM lands; ``leftovers()`` lists what a network with a given tag left behind, for tests
to check. A process killed with -9 cannot remove its network: each network records its
owner (pid and start time) under /run/paramserver-netns first, and the next one made on the
host removes every network whose owner is gone (``sweep``); a bridge left holding the root
namespace's address would otherwise take its replies, and the new run's workers would wait
for servers they cannot reach. Addresses are the private 10.213.0.0/24, only the
namespaces' own.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from types import FrameType, TracebackType

from paramserver.cluster import procs
from paramserver.errors import ConfigError

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
ROOT_ADDRESS = "10.213.0.254"  # the root namespace's, on the bridge (``Network.reach_root``)
OWNERS = Path("/run/paramserver-netns")  # OWNERS/TAG: "PID STARTTIME" of a network's maker

log = logging.getLogger(__name__)


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


def rate_bits(rate: str) -> float:
    """``100mbit``, ``1gbit``, ``10gbit`` (tc's units) in bits per second.

    Raises:
        ConfigError: not a number followed by kbit, mbit, gbit or bit.
    """
    text = rate.strip().lower()
    for unit, scale in _UNITS.items():
        if text.endswith(unit):
            try:
                value = float(text[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return value * scale
    raise ConfigError(f"--rate {rate!r}: give a positive rate in kbit, mbit or gbit (1gbit).")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Network:
    """A bridge and one namespace per host name, on 10.213.0.0/24; each host's link shaped
    to ``rate`` (tc's units, e.g. ``1gbit``) in both directions when given."""

    def __init__(self, hosts: list[str], rate: str | None = None):
        self.tag = os.getpid() % 100000
        self.bridge = f"psbr{self.tag}"
        self.ns = {h: f"ps{self.tag}-{h}" for h in hosts}
        self.addr = {h: f"10.213.0.{i + 1}" for i, h in enumerate(hosts)}
        self.rate = rate
        self.procs: list[subprocess.Popen | procs.Forked] = []
        self._made: list[str] = []
        self._links: list[str] = []
        self._forward = False
        self._sigterm: object = None
        sweep()
        _record_owner(self.tag)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            # A Docker engine sets iptables' FORWARD policy to DROP, and with br_netfilter
            # that drops traffic across this bridge too: let it through, and take the rule
            # out again in close().
            # recorded before it is made, as everything here: a signal may land mid-call
            self._forward = shutil.which("iptables") is not None
            self._iptables("-I")
            for i, host in enumerate(hosts):
                self._add_host(i, host, hosts)
        except BaseException:
            self.close()
            raise

    def _add_host(self, i: int, host: str, hosts: list[str]) -> None:
        ns = self.ns[host]
        self._made.append(ns)  # before it exists: close() removes what a signal cut short
        _ip("netns", "add", ns)
        outside, inside = self.link(host), self.ifname(host)
        self._links.append(outside)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if self.rate is not None:
            self._shape(outside, None)  # into the host
            self._shape(inside, ns)  # out of it
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        etc.joinpath("hosts").write_text(
            "127.0.0.1 localhost\n" + "".join(f"{self.addr[h]} {h}\n" for h in hosts)
        )

    def _shape(self, dev: str, ns: str | None) -> None:
        """A token bucket on ``dev``'s egress: ``rate``, a burst of 10 ms of it (at least
        64 KiB, which tbf needs to reach the rate at the kernel's timer resolution)."""
        assert self.rate is not None
        burst = max(64 << 10, int(rate_bits(self.rate) / 8 / 100))
        where = ["-n", ns] if ns else []
        argv = ["tc", *where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate]
        argv += ["burst", str(burst), "latency", "50ms"]
        subprocess.run(argv, check=True, capture_output=True, text=True)

    def __enter__(self) -> Network:
        """SIGTERM, while the body runs in the main thread, raises SystemExit there so that
        ``close`` removes the network (the default action would leave it behind)."""
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._sigterm = signal.signal(signal.SIGTERM, _terminated)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.close()
        finally:
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)  # type: ignore[arg-type]
                self._sigterm = None

    def reach_root(self) -> str:
        """Give the root namespace an address on the bridge: a process there (a server)
        listening at it serves the namespaces' hosts; gone with the bridge in ``close``.

        Raises:
            ConfigError: a network of a process still running holds the address.
        """
        held = subprocess.run(
            ["ip", "-o", "-4", "addr", "show", "to", ROOT_ADDRESS],
            capture_output=True,
            text=True,
        ).stdout.split()
        if len(held) > 1 and held[1] != self.bridge:
            raise ConfigError(
                f"{ROOT_ADDRESS} is on {held[1]} already, the network of a run still going "
                f"(pid {_owner_pid(held[1])}): one run with its servers on the bridge at a "
                "time on a host; wait for it to end, or stop it."
            )
        _ip("addr", "add", f"{ROOT_ADDRESS}/24", "dev", self.bridge)
        return ROOT_ADDRESS

    def link(self, host: str) -> str:
        """The root namespace's end of ``host``'s veth pair (on the bridge)."""
        return f"psv{self.tag}x{list(self.ns).index(host)}"

    def ifname(self, host: str) -> str:
        """``host``'s end of its veth pair, inside its namespace."""
        return f"psv{self.tag}y{list(self.ns).index(host)}"

    def cut(self, host: str) -> None:
        """Take ``host``'s link down: nothing reaches it or leaves it until ``restore``."""
        _ip("link", "set", self.link(host), "down")

    def restore(self, host: str) -> None:
        _ip("link", "set", self.link(host), "up")

    def wire_bytes(self, host: str) -> tuple[int, int]:
        """Bytes so far into ``host`` and out of it, as its link counted them."""
        stats = Path("/sys/class/net") / self.link(host) / "statistics"
        into = int((stats / "tx_bytes").read_text())  # the bridge's end sends into the host
        out = int((stats / "rx_bytes").read_text())
        return into, out

    def argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def run(
        self, host: str, argv: list[str], env: dict[str, str], log: Path
    ) -> subprocess.Popen | procs.Forked:
        """Start ``argv`` inside ``host``'s namespace, output to ``log``; ``close`` kills it."""
        with open(log, "wb") as out:
            proc = procs.start(  # a python -m there is forked, in the namespace
                self.argv(host, argv),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def call(
        self, host: str, argv: list[str], env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        return procs.run(self.argv(host, argv), timeout, env=env)

    def close(self) -> None:
        """Kills what ``run`` started and removes everything made; safe to call twice."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        self.procs.clear()
        for link in self._links:  # the pair and its qdiscs; not left to the namespace's end,
            subprocess.run(["ip", "link", "del", link], capture_output=True)  # which lags
        self._links.clear()
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self._made.clear()
        if self._forward:
            self._iptables("-D")
            self._forward = False
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        (OWNERS / str(self.tag)).unlink(missing_ok=True)

    def _iptables(self, action: str) -> int:
        """Insert (-I) or delete (-D) the rule that accepts traffic across the bridge."""
        if shutil.which("iptables") is None:
            return 1
        return _iptables(action, self.bridge)


def _iptables(action: str, bridge: str) -> int:
    rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    return subprocess.run(["iptables", action, *rule], capture_output=True).returncode


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(f"signal {signum}: removing the network namespaces this run made")


def _start_time(pid: int) -> str | None:
    """Process ``pid``'s start time (clock ticks after boot), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _record_owner(tag: int) -> None:
    OWNERS.mkdir(parents=True, exist_ok=True)
    (OWNERS / str(tag)).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")


def _owner_pid(bridge: str) -> str:
    try:
        return (OWNERS / bridge.removeprefix("psbr")).read_text().split()[0]
    except (OSError, IndexError):
        return "unknown"


def _alive(tag: int) -> bool:
    """Whether the process that made network ``tag`` still runs (the same process: its
    start time as recorded). A network from before owners were recorded has none: its
    tag was its maker's pid, which is then checked."""
    try:
        pid, started = (OWNERS / str(tag)).read_text().split()
    except (OSError, ValueError):
        return _start_time(tag) is not None
    return _start_time(int(pid)) == started


def _tags() -> set[int]:
    """The tags of every network on the host, whole or in pieces."""
    found = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    etc = Path("/etc/netns")
    found += " ".join(p.name for p in etc.iterdir()) if etc.exists() else ""
    if shutil.which("iptables") is not None:
        found += subprocess.run(
            ["iptables", "-S", "FORWARD"], capture_output=True, text=True
        ).stdout
    found += " ".join(f"ps{p.name}-" for p in OWNERS.iterdir()) if OWNERS.exists() else ""
    return {int(t) for t in re.findall(r"\bps(?:br|v)?(\d+)(?:-|x|y|\b)", found)}


def sweep() -> list[int]:
    """Remove every network whose maker is gone (killed with -9, say); the tags removed."""
    gone = sorted(t for t in _tags() if not _alive(t))
    for tag in gone:
        log.warning("removing network namespaces a run that is gone left (tag %d)", tag)
        for name in leftovers(tag):
            if name.startswith("/etc/netns/"):
                shutil.rmtree(name, ignore_errors=True)
            elif name.startswith(str(OWNERS)):
                continue  # below, once the rest is gone
            elif name.startswith("-A FORWARD"):
                _iptables("-D", f"psbr{tag}")
            elif name.startswith(f"ps{tag}-"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        (OWNERS / str(tag)).unlink(missing_ok=True)
    return gone


def leftovers(tag: int) -> list[str]:
    """What networks with ``tag`` left behind: namespaces, links, /etc/netns folders, the
    iptables rule for the bridge, and the owner's record."""
    found = []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [n.split()[0] for n in names.splitlines() if n.startswith(f"ps{tag}-")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    ours = (f"psbr{tag}:", f"psv{tag}x")
    found += [
        ln.split(":")[1].strip().split("@")[0]
        for ln in links.splitlines()
        if any(o in ln for o in ours)
    ]
    etc = Path("/etc/netns")
    found += [str(p) for p in etc.glob(f"ps{tag}-*")] if etc.exists() else []
    if shutil.which("iptables") is not None:
        rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True)
        found += [r for r in rules.stdout.splitlines() if f"-i psbr{tag} " in r]
    found += [str(OWNERS / str(tag))] if (OWNERS / str(tag)).exists() else []
    return found
