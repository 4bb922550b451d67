"""A worker cannot crash the server through its shared segment, nor get round the gradient
checks by changing the segment under the server: the server copies a pushed gradient into
its own memory before checking it, and maps only a sealed segment, whose size nobody can
change (a named one, which its worker may truncate, would kill it with SIGBUS)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

import paramserver as ps
from paramserver._proto import paramserver_pb2 as pb
from paramserver.cluster.procs import READY_MARKER, Child, stop_all
from paramserver.codec import wire
from paramserver.server.engine import checks as checks_module
from paramserver.transport import attachments, shm
from paramserver.transport.channels import ControlSocket
from paramserver.transport.stub import Stub, connect
from tests.conftest import DEADLINE

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm here")

SLOTS = 2


class Peer:
    """A worker made of raw gRPC calls and the real segment: it keeps a descriptor of its
    segment after the name is gone, to do to it what a buggy or hostile worker might."""

    def __init__(self, address: str, name: str, train_samples: int = 0, sealed: bool = False):
        self.channel = connect(address, 10)
        self.stub = Stub(self.channel)
        join = pb.JoinRequest(name=name, train_samples=train_samples)
        first = self.stub.Join(join, timeout=10)  # to learn the model's size
        self.segment = shm.Segment(
            first.manifest.total_bytes, SLOTS, first.manifest.dtype or "float32", sealed=sealed
        )
        self.fd = os.open(self.segment.path, os.O_RDWR)
        request = pb.JoinRequest(
            name=name,
            worker_id=first.worker_id,
            shm_name=self.segment.name,
            shm_nonce=self.segment.nonce,
            shm_slots=SLOTS,
        )
        self.reply = self.stub.Join(request, timeout=10)
        self.segment.unlink()
        assert self.reply.shm, "the server did not map the segment"
        self.worker_id = self.reply.worker_id
        self.clock = self.reply.clock

    def push(self, slot: int = 0) -> pb.PushPullRequest:
        header = pb.PushHeader(
            worker_id=self.worker_id,
            iteration=self.clock,
            shm=True,
            shm_slot=slot,
            samples=1,
            incarnation=self.reply.incarnation,
        )
        return pb.PushPullRequest(push=header)

    def pull(self) -> pb.PullRequest:
        return pb.PullRequest(
            worker_id=self.worker_id,
            iteration=self.clock,
            shm=True,
            incarnation=self.reply.incarnation,
        )

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)

    def close(self) -> None:
        os.close(self.fd)
        self.segment.close()
        self.channel.close()


def _known(stub: Stub) -> set[str]:
    return {w.worker_id for w in stub.Status(pb.StatusRequest(), timeout=10).workers}


def _refused_and_dropped(server: Child, stub: Stub, peer: Peer, call) -> None:
    with pytest.raises((grpc.RpcError, OSError)) as err:  # OSError: the control socket closed
        call()
    assert server.poll() is None, f"the server died with status {server.poll()}: {server.tail(5)}"
    assert isinstance(err.value, grpc.RpcError), err.value
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "segment" in err.value.details() and peer.worker_id in err.value.details()
    assert peer.worker_id not in _known(stub)  # dropped: its lease and its batches are gone
    with pytest.raises(grpc.RpcError) as err:
        peer.stub.Heartbeat(pb.HeartbeatRequest(worker_id=peer.worker_id), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_truncated_segment_is_refused_and_its_worker_dropped_the_server_goes_on(tmp_path):
    server = Child(
        "server",
        [
            "server",
            "--run-dir",
            "off",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--model",
            "mlp",
            "--dataset",
            "synthetic",
            "--policy",
            "async",
            "--workers",
            "4",
            "--min-workers",
            "1",
            "--optimizer",
            "sgd",
            "--lr",
            "0.1",
        ],
        tmp_path / "server.log",
        capture_stdout=True,
    )
    peers: list[Peer] = []
    try:
        address = server.wait_for_line(READY_MARKER, DEADLINE).rsplit(" ", 1)[-1]
        observer = Peer(address, "observer")  # its segment stays whole
        peers.append(observer)
        size = shm.segment_bytes(observer.segment.total_bytes, SLOTS)

        # a pull into a segment truncated to nothing, through gRPC
        peer = Peer(address, "truncates-then-pulls")
        peers.append(peer)
        peer.truncate(0)
        _refused_and_dropped(
            server, observer.stub, peer, lambda: list(peer.stub.Pull(peer.pull(), timeout=10))
        )

        # a push from a slot past the end of a segment cut in half, through gRPC
        half = Peer(address, "halves-then-pushes")
        peers.append(half)
        half.truncate(size // 2)
        _refused_and_dropped(
            server,
            observer.stub,
            half,
            lambda: half.stub.PushPull(half.push(SLOTS - 1), timeout=10),
        )

        # a push and pull through the control socket, the segment gone
        ringer = Peer(address, "truncates-then-rings")
        peers.append(ringer)
        control = ControlSocket(
            ringer.reply.shm_control, ringer.worker_id, ringer.segment.nonce, 10
        )
        try:
            ringer.truncate(0)
            request = ringer.push()
            request.pull.CopyFrom(ringer.pull())
            request.pull.iteration += 1  # a step pulls the iteration after its push
            _refused_and_dropped(
                server, observer.stub, ringer, lambda: control.push_pull(request, 10)
            )
        finally:
            control.close()

        # the others go on: a well-behaved worker trains through its own segment
        observer.close()
        peers.remove(observer)
        with ps.Worker(address) as worker:
            assert worker.shm_active
            for _ in range(3):
                for p in worker.model.parameters():
                    p.grad = torch.full_like(p, 0.01)
                worker.step(samples=1)
            got = torch.cat([p.detach().reshape(-1) for p in worker.model.parameters()])
            assert torch.isfinite(got).all()
            status = worker.status()
            assert status.version == 3
        assert server.poll() is None
    finally:
        for p in peers:
            p.close()
        stop_all([server])
    assert server.proc.returncode == 0, server.tail(5)  # SIGTERM: a last checkpoint, exit 0


def test_a_segment_truncated_while_its_pull_is_answered_gives_the_pulls_batch_back(
    serve, monkeypatch
):
    """The worker truncates its segment after the server checked it, before the weights are
    written (under the server's lock, once the pull took a batch): refused, dropped, and its
    batch goes to another worker."""
    server = serve("mlp", workers=2, min_workers=1, policy="async", batch_size=32)
    peer = Peer(server.address, "truncates-after-the-check", train_samples=320)
    other = Peer(server.address, "other")
    check = server.shared.check

    def check_then_truncate(worker_id: str) -> None:
        check(worker_id)
        if worker_id == peer.worker_id:
            peer.truncate(0)

    monkeypatch.setattr(server.shared, "check", check_then_truncate)
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(peer.stub.Pull(peer.pull(), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "holds 0 bytes" in err.value.details()
        assert peer.worker_id not in {w["worker_id"] for w in server.status()["workers"]}
        out = other.segment.weights
        header, _ = wire.decode_pull(other.stub.Pull(other.pull(), timeout=10), out, out.nbytes)
        assert header.shm and list(header.batches) == [0]  # the batch the broken pull took
        np.testing.assert_array_equal(out, server.coordinator.store.weights)
    finally:
        peer.close()
        other.close()


# A process that flips one value of a slot between NaN and 0 as fast as it can, from the
# moment it prints "flipping" until it is killed.
FLIPPER = """
import mmap, os, sys
import numpy as np
path, offset = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, os.fstat(fd).st_size)
v = np.frombuffer(m, np.float32, 1, offset)
v[0] = np.nan
print("flipping", flush=True)
nan, zero = np.float32("nan"), np.float32(0)
while True:
    v[0] = nan
    v[0] = zero
"""


SEALED = [False, True] if shm.sealing_available() else [False]


@pytest.mark.parametrize("sealed", SEALED)
def test_a_gradient_changed_while_it_is_pushed_never_brings_nan_into_the_weights(serve, sealed):
    """Another process flips one value of the slot while the worker
    pushes from it. Before the gradient was copied first, a NaN got into the weights in
    most runs (not all: the flips must land between the check and the step); the next test
    makes them land there every time."""
    server = serve("mlp", workers=1, policy="async", optimizer="sgd", lr=0.1, skip_nonfinite=False)
    peer = Peer(server.address, "flips-while-pushing", sealed=sealed)
    slot_offset = shm.segment_bytes(peer.segment.total_bytes, 0)  # where slot 0 starts
    flipper = None
    try:
        peer.segment.slots[0][:] = 0.001
        flipper = subprocess.Popen(
            [
                sys.executable,
                "-c",
                FLIPPER,
                f"/proc/{os.getpid()}/fd/{peer.fd}",
                str(slot_offset + 4 * 1000),
            ],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        assert flipper.stdout is not None
        assert flipper.stdout.readline().strip() == b"flipping"
        applied = refused = 0
        for _ in range(200):
            try:
                peer.stub.PushPull(peer.push(0), timeout=10)
                applied += 1
                peer.clock += 1
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
                assert "NaN or Inf" in err.details()
                refused += 1
            weights = server.coordinator.store.weights
            assert np.isfinite(weights).all(), (
                f"NaN in the weights after {applied} pushes applied and {refused} refused"
            )
        assert server.status()["version"] == applied
    finally:
        if flipper is not None:
            flipper.kill()
            flipper.wait(DEADLINE)
            assert flipper.stdout is not None
            flipper.stdout.close()
        peer.close()


@pytest.mark.parametrize("sealed", SEALED)
def test_a_gradient_changed_right_after_its_check_is_applied_as_it_was_checked(
    serve, monkeypatch, sealed
):
    """The worst moment for the worker's change, every time: between the check and the
    optimizer's step the worker writes a NaN into the slot it pushed from."""
    server = serve("mlp", workers=1, policy="async", optimizer="sgd", lr=0.5, skip_nonfinite=False)
    peer = Peer(server.address, "writes-after-the-check", sealed=sealed)
    before = server.coordinator.store.weights.copy()
    real = checks_module.check_gradient
    checks: list[bool] = []

    def check_then_flip(grad, *args, **kwargs):
        finite = real(grad, *args, **kwargs)
        checks.append(finite)
        peer.segment.slots[0][1000] = np.nan  # the worker's write, right after the check
        return finite

    monkeypatch.setattr(checks_module, "check_gradient", check_then_flip)
    try:
        peer.segment.slots[0][:] = 0.25
        peer.stub.PushPull(peer.push(0), timeout=10)
        assert checks == [True]
        weights = server.coordinator.store.weights
        assert np.isfinite(weights).all(), "the NaN written after the check was applied"
        n = server.coordinator.manifest.section("param")[1]  # sgd: w - lr * g, as checked
        np.testing.assert_allclose(weights[:n], before[:n] - 0.5 * 0.25, rtol=1e-6)
        peer.clock += 1
        with pytest.raises(grpc.RpcError) as err:  # pushed again, the NaN is seen and refused
            peer.stub.PushPull(peer.push(0), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "NaN or Inf" in err.value.details()
        assert server.status()["version"] == 1
    finally:
        peer.close()


def test_the_server_copies_a_segment_only_while_it_keeps_its_size():
    seg = shm.Segment(1024, SLOTS, sealed=False)
    fd = os.open(seg.path, os.O_RDWR)
    fifo = os.path.join(shm.SHM_DIR, f"{seg.name}-fifo")
    att = attachments.Attachments(1024)
    try:
        os.mkfifo(fifo, 0o600)  # not a regular file: declined (a read of it would block)
        assert not att.attach("w0", os.path.basename(fifo), seg.nonce, SLOTS)
        assert att.attach("w1", seg.name, seg.nonce, SLOTS)
        seg.unlink()
        seg.slots[1][:] = 7.0
        got = att.gradient("w1", 1)
        seg.slots[1][:] = np.nan  # the worker's later writes do not reach the server's copy
        assert (got == 7.0).all()
        att.put_weights("w1", np.full(256, 3.0, np.float32))
        assert (seg.weights == 3.0).all()
        size = shm.segment_bytes(1024, SLOTS)
        for wrong in (size + 4096, size // 2, 0):
            os.ftruncate(fd, wrong)
            for call in (
                lambda: att.check("w1"),
                lambda: att.gradient("w1", 0),
                lambda: att.put_weights("w1", np.zeros(256, np.float32)),
            ):
                with pytest.raises(shm.BrokenSegment, match=f"holds {wrong} bytes"):
                    call()
        att.detach("w1")
        with pytest.raises(ps.ParamServerError, match="no segment"):
            att.gradient("w1", 0)
    finally:
        att.close()
        os.close(fd)
        seg.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(fifo)


@pytest.mark.skipif(not shm.sealing_available(), reason="no memfd seals here")
def test_a_sealed_segment_cannot_change_size_and_only_such_a_one_is_mapped():
    seg = shm.Segment(1024, SLOTS, sealed=True)
    att = attachments.Attachments(1024)
    fd = os.open(seg.path, os.O_RDWR)
    token = seg.name.split(".fd")[0]
    plain = os.memfd_create(token, os.MFD_CLOEXEC)  # a memfd nobody sealed
    try:
        for size in (0, 512, shm.segment_bytes(1024, SLOTS) * 2):
            with pytest.raises(PermissionError):  # F_SEAL_SHRINK, F_SEAL_GROW: not even its worker
                os.ftruncate(fd, size)
        # names that do not lead to the worker's memfd are declined before anything is read
        assert not att.attach("w0", f"{token}.fd{fd + 1000}", seg.nonce, SLOTS)  # no such fd
        other = token[:-1] + ("1" if token.endswith("0") else "0")  # another memfd's name
        assert not att.attach("w0", f"{other}.fd{fd}", seg.nonce, SLOTS)
        with open(os.devnull, "rb") as null:  # a file that is no memfd under a memfd's name
            assert not att.attach("w0", f"{token}.fd{null.fileno()}", seg.nonce, SLOTS)
        assert att.attach("w1", seg.name, seg.nonce, SLOTS)
        assert att._by_worker["w1"].mapping is not None  # sealed: mapped
        seg.slots[1][:] = 7.0
        got = att.gradient("w1", 1)
        seg.slots[1][:] = np.nan  # the worker's later writes do not reach the server's copy
        assert (got == 7.0).all()
        att.put_weights("w1", np.full(256, 3.0, np.float32))
        assert (seg.weights == 3.0).all()
        # an unsealed memfd under a sealed-looking name is used, but never mapped
        os.ftruncate(plain, shm.segment_bytes(1024, SLOTS))
        os.pwrite(plain, seg.nonce, 0)
        assert att.attach("w2", f"{token}.fd{plain}", seg.nonce, SLOTS)
        assert att._by_worker["w2"].mapping is None
        os.ftruncate(plain, 0)  # and its worker may truncate it: refused, not a SIGBUS
        with pytest.raises(shm.BrokenSegment, match="holds 0 bytes"):
            att.gradient("w2", 0)
        att.detach("w1")
        with pytest.raises(ps.ParamServerError, match="no segment"):
            att.gradient("w1", 0)
    finally:
        att.close()
        os.close(fd)
        os.close(plain)
        seg.close()
