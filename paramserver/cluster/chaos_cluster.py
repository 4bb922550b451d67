"""The local cluster ``paramserver chaos`` runs and hurts: server shards and worker daemons
as child processes, started, killed, stopped and started again on the same ports; its
progress read from the shards' Status; and a reader that loads the newest checkpoint of
every shard over and over while the run goes on (``Reader``).

With a ``Network`` (for link faults) every worker runs in a namespace of its own, host
``wJ``, and reaches the servers over its link at the root namespace's bridge address,
where they listen; its payloads go over gRPC then (``--shm off``: a shared segment and its
same-host socket would not cross a cut link)."""

from __future__ import annotations

import logging
import os
import resource
import signal
import threading
import time
from pathlib import Path

import grpc
import torch
from torch import nn
from torch.utils.data import TensorDataset

from paramserver._proto import paramserver_pb2 as pb
from paramserver.cluster.netns import Network
from paramserver.cluster.procs import READY_MARKER, Child
from paramserver.errors import ConfigError
from paramserver.server.disk import checkpoint
from paramserver.server.disk.row_reader import RowChain
from paramserver.training import clicks
from paramserver.transport.stub import Stub, connect

log = logging.getLogger(__name__)
TRAIN, TEST, DIM = 3072, 8192, 8  # the chaos run's click log (48 batches of 64 an epoch)
# ids a field: few enough that the model learns the teacher (about 71% test accuracy against
# 60% for the majority class; at 10,000 it stayed at the majority's, and the accuracy check
# of worker faults compared two runs that had learnt nothing)
ROWS = 100


class ChaosModel(nn.Module):
    """A sparse table of every field's ids, BatchNorm over the embeddings and a dense head:
    the model ``paramserver chaos`` trains (``--model paramserver.cluster.chaos_cluster:
    model``)."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(clicks.FIELDS * ROWS, DIM, sparse=sparse)
        self.norm = nn.BatchNorm1d(clicks.FIELDS * DIM)
        self.head = nn.Linear(clicks.FIELDS * DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x + torch.arange(clicks.FIELDS, device=x.device) * ROWS
        return self.head(torch.relu(self.norm(self.emb(ids).flatten(1))))  # type: ignore[no-any-return]


def model() -> nn.Module:
    return ChaosModel()


def dense_model() -> nn.Module:
    """The same with its table dense (in the flat parameters): the model of ``chaos
    --local-steps``, whose pseudo-gradients cover dense parameters only."""
    return ChaosModel(sparse=False)


def data() -> tuple[TensorDataset, TensorDataset]:
    """The chaos run's data set (``--dataset paramserver.cluster.chaos_cluster:data``)."""
    train_x, train_y, test_x, test_y = clicks.make(train=TRAIN, test=TEST, seed=1, rows=ROWS)
    return TensorDataset(train_x, train_y), TensorDataset(test_x, test_y)


MODEL = "paramserver.cluster.chaos_cluster:model"
DENSE_MODEL = "paramserver.cluster.chaos_cluster:dense_model"
DATA = "paramserver.cluster.chaos_cluster:data"


class Cluster:
    """``shards`` server processes and ``workers`` worker daemons of one run in ``root``."""

    def __init__(
        self,
        root: Path,
        shards: int,
        workers: int,
        server_args: list[str],
        worker_args: list[str],
        net: Network | None = None,
    ):
        self.root, self.shards, self.workers = root, shards, workers
        self.server_args, self.worker_args = server_args, worker_args
        self.net = net
        self.host = net.reach_root() if net is not None else "127.0.0.1"
        self.ports = [0] * shards
        self.servers: list[Child | None] = [None] * shards
        self.procs: list[Child] = []  # every child ever started, to stop at the end
        self.worker_procs: list[Child | None] = [None] * workers
        self.starts = 0

    @property
    def addresses(self) -> list[str]:
        return [f"{self.host}:{p}" for p in self.ports]

    def start_server(self, i: int, timeout: float) -> None:
        self.starts += 1
        child = Child(
            f"shard{i}-{self.starts}",
            [
                "server",
                "--host",
                self.host,
                "--port",
                str(self.ports[i]),
                "--shard",
                f"{i}/{self.shards}",
                *self.server_args,
            ],
            self.root / f"shard{i}-{self.starts}.log",
            capture_stdout=True,
        )
        self.procs.append(child)
        self.servers[i] = child
        line = child.wait_for_line(READY_MARKER, timeout)
        self.ports[i] = int(line.rsplit(":", 1)[1])

    def start_worker(self, j: int) -> None:
        self.starts += 1
        child = Child(
            f"worker{j}-{self.starts}",
            [
                "worker",
                "--server",
                ",".join(self.addresses),
                "--name",
                f"w{j}",
                "--batch-log",
                str(self.root / f"batches-w{j}-{self.starts}.log"),
                *self.worker_args,
                *(["--shm", "off"] if self.net is not None else []),
            ],
            self.root / f"worker{j}-{self.starts}.log",
            prefix=self.net.argv(f"w{j}", []) if self.net is not None else (),
        )
        self.procs.append(child)
        self.worker_procs[j] = child

    def signal_server(self, i: int, sig: int) -> None:
        child = self.servers[i]
        assert child is not None
        os.kill(child.proc.pid, sig)
        if sig == signal.SIGKILL:
            child.proc.wait(30)

    def signal_worker(self, j: int, sig: int) -> None:
        child = self.worker_procs[j]
        assert child is not None
        if child.poll() is None:
            os.kill(child.proc.pid, sig)
            if sig == signal.SIGKILL:
                child.proc.wait(30)

    def link(self, j: int, up: bool) -> None:
        """Take worker ``j``'s link down, or up again (a ``Network`` is needed)."""
        assert self.net is not None, "link faults need the workers in namespaces"
        (self.net.restore if up else self.net.cut)(f"w{j}")

    def file_limit(self, i: int, limit: int | None) -> None:
        """Make shard ``i``'s writes fail past ``limit`` bytes (a full disk); None: lift it."""
        child = self.servers[i]
        assert child is not None
        _, hard = resource.prlimit(child.proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(
            child.proc.pid, resource.RLIMIT_FSIZE, (limit if limit is not None else hard, hard)
        )

    def workers_done(self) -> bool:
        return all(w is not None and w.poll() is not None for w in self.worker_procs)

    def status(self, i: int, timeout: float = 5.0) -> pb.StatusResponse | None:
        try:
            channel = connect(self.addresses[i], timeout)
        except Exception:  # noqa: BLE001 - down, or starting
            return None
        try:
            return Stub(channel).Status(pb.StatusRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
        finally:
            channel.close()

    def progress(self) -> int | None:
        """The run's progress: the smallest version over the shards (None: one is down)."""
        versions = []
        for i in range(self.shards):
            st = self.status(i)
            if st is None:
                return None
            versions.append(st.version)
        return min(versions)


class Reader(threading.Thread):
    """Loads the newest checkpoint of every shard (its file, and every row file it names,
    checked against their sizes and checksums) again and again until stopped; counts the
    reads and the failures. A file deleted between listing and reading (a newer cut made it
    old) is not a failure."""

    def __init__(self, directory: Path, shards: int):
        super().__init__(name="chaos-reader", daemon=True)
        self.directory, self.shards = directory, shards
        self.reads, self.failures = 0, []  # type: ignore[var-annotated]
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.2):
            for i in range(self.shards):
                cuts = checkpoint.list_cuts(self.directory, i, self.shards)
                if cuts:
                    self._read(cuts[max(cuts)])

    def _read(self, path: Path) -> None:
        try:
            state = checkpoint.with_rows(checkpoint.load(path), path)
            if isinstance(state.get("tables"), RowChain):
                state["tables"].folders()
            self.reads += 1
        except (ConfigError, RuntimeError, OSError, EOFError) as exc:
            if path.exists():
                self.failures.append(f"{path.name}: {exc}")
                log.error("checkpoint %s unreadable: %s", path, exc)

    def stop(self) -> None:
        self._done.set()
        self.join(30)


def wait_until(condition, timeout: float, every: float = 0.1) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``condition`` until it holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)  # polling other processes; bounded by the deadline
    return False
