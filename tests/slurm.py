"""A real Slurm cluster for tests, on one machine: munged, slurmctld and two slurmd (nodes
n1 and n2, both 127.0.0.1 on their own ports) started without systemd, in a temporary
folder, with deadlines; ``close()`` stops them all. Needs root and Debian's slurmctld,
slurmd, slurm-client and munge."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
NODES = ("n1", "n2")


def unavailable() -> str | None:
    """Why a Slurm cluster cannot be made here, or None."""
    if os.geteuid() != 0:
        return "slurmd and munged need root; CI runs the tests as root"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian slurmctld slurmd slurm-client munge; make installs them as root)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (the munge package makes it)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONF = """\
ClusterName=pstest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={home}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={home}/state
SlurmdSpoolDir={home}/spool-%n
SlurmctldPidFile={home}/slurmctld.pid
SlurmdPidFile={home}/slurmd-%n.pid
SlurmctldLogFile={home}/slurmctld.log
SlurmdLogFile={home}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
InactiveLimit=0
KillWait=30
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
JobRequeue=1
NodeName=n1 NodeAddr=127.0.0.1 NodeHostname={host} Port={port1} CPUs=2 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 NodeHostname={host} Port={port2} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class Cluster:
    """munged, slurmctld and a slurmd per node, configured in ``home``."""

    def __init__(self, home: Path, deadline: float = 60.0):
        self.home = home
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(home / "slurm.conf"))
        munge = home / "munge"
        munge.mkdir()
        for d in ("state", *(f"spool-{n}" for n in NODES)):
            (home / d).mkdir()
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ids = pwd.getpwnam("munge")
        for p in (munge, key):
            os.chown(p, ids.pw_uid, ids.pw_gid)
        home.chmod(0o755)
        munge.chmod(0o711)  # munged: the socket's folder searchable by all, written by it alone
        (home / "slurm.conf").write_text(
            CONF.format(
                home=home,
                host=socket.gethostname(),
                ctld_port=_free_port(),
                port1=_free_port(),
                port2=_free_port(),
            )
        )
        try:
            self._start(
                [
                    "runuser",
                    "-u",
                    "munge",
                    "--",
                    "munged",
                    "--foreground",
                    f"--key-file={key}",
                    f"--socket={munge}/munge.socket",
                    f"--pid-file={munge}/munged.pid",
                    f"--log-file={munge}/munged.log",
                    f"--seed-file={munge}/munged.seed",
                ],
                "munged",
            )
            self._wait("munged", lambda: (munge / "munge.socket").exists(), deadline)
            self._start(["slurmctld", "-D", "-i"], "slurmctld")
            self._wait("slurmctld", lambda: self._ok(["scontrol", "ping"]), deadline)
            for node in NODES:
                self._start(["slurmd", "-D", "-N", node], f"slurmd-{node}")
            self._wait("both nodes idle", self._idle, deadline)
        except BaseException:
            self.close()
            raise

    def _start(self, argv: list[str], name: str) -> None:
        with open(self.home / f"{name}.out", "wb") as out:
            self.procs.append(
                subprocess.Popen(
                    argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    def _ok(self, argv: list[str]) -> bool:
        return subprocess.run(argv, env=self.env, capture_output=True, timeout=30).returncode == 0

    def _idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(n, "").startswith("idle") for n in NODES)

    def _wait(self, what: str, ready, deadline: float) -> None:
        end = time.monotonic() + deadline
        while not ready():
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > end:
                logs = "".join(
                    f"\n--- {f.name}\n{f.read_text(errors='replace')[-1500:]}"
                    for f in sorted(self.home.glob("*.log")) + sorted(self.home.glob("*.out"))
                )
                raise RuntimeError(f"Slurm: {what} not ready within {deadline:.0f} s{logs}")
            time.sleep(0.2)  # polling daemons we do not control; the deadline bounds it

    def run(self, argv: list[str], check: bool = True, timeout: float = 60) -> str:
        out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")
        return out.stdout

    def _jobs(self) -> list[str]:
        out = self.run(["squeue", "-h", "-o", "%A"], check=False)
        return [line for line in out.split() if line.strip()]

    def run_env(self, argv: list[str], env: dict[str, str], timeout: float = 60) -> str:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")
        return out.stdout

    def close(self) -> None:
        """Cancel every job and wait for it to end (its slurmstepd outlive slurmd), then
        stop the daemons."""
        if self.procs and self.procs[-1].poll() is None:
            self.run(["scancel", "--full", "--signal=KILL", *self._jobs()], check=False)
            end = time.monotonic() + 60
            while self._jobs() and time.monotonic() < end:
                time.sleep(0.5)  # polling slurmctld; bounded by the deadline
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
