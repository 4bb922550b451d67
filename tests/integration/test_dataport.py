"""The data port (server/doors/dataport.py, transport/tcp.py): what workers on other hosts step
over. It computes what gRPC streams compute, it is offered and taken only as the settings
say, and a peer without the token, the Join's nonce or honest sizes is refused before
anything it sends is read or applied. TLS on it is in test_security.py."""

from __future__ import annotations

import socket

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver._proto import paramserver_pb2 as pb
from paramserver.codec import records
from paramserver.config import Security
from paramserver.errors import ConfigError
from paramserver.training import data
from paramserver.transport import shm
from paramserver.transport.tcp import DataSocket, host_of
from tests.conftest import DEADLINE, replica, tiny_model

TOKEN = "s3cret"


def _train(address: str, model, steps: int, shm: bool = False, **kw) -> dict[str, torch.Tensor]:
    ds = data.synthetic(train=256, test=16)
    with ps.Worker(address, model, shm=shm, overlap=False, **kw) as w:
        assert w.shm_active is shm
        assert w.data_port_active is (not shm and kw.get("wire", "auto") == "auto")
        for step in range(steps):
            idx = data.batch_indices(len(ds.train_x), 0, 16, step)
            F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx]).backward()
            w.step(samples=len(idx))
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("compress", ["none", "bf16", "topk:0.05:bf16", "int8"])
@pytest.mark.parametrize("policy", ["sync", "delay-1"])
def test_the_data_port_computes_what_grpc_streams_compute(serve, policy, compress):
    """And a shared segment the same, 16-bit rounding and top-k's and int8's error feedback
    included (in place there)."""
    start = tiny_model()
    runs = {}
    paths = {"grpc": {"wire": "grpc"}, "auto": {"wire": "auto"}}
    if shm.available():
        paths["shm"] = {"shm": True}
    for path, kw in paths.items():
        server = serve(replica(start), optimizer="sgd", lr=0.1, policy=policy)
        runs[path] = _train(server.address, replica(start), 12, compress=compress, **kw)
        status = server.status()
        assert (status["version"], status["pushes_applied"]) == (12, 12)
    for path in paths:
        for name, tensor in runs["grpc"].items():
            assert torch.equal(runs[path][name], tensor), (path, name)


def test_the_data_port_is_offered_and_taken_only_as_the_settings_say(serve, caplog):
    off = serve(tiny_model(), policy="async", data_port="off")
    assert off.data is None
    _train(off.address, tiny_model(), 1, wire="grpc")
    with ps.Worker(off.address, tiny_model(), shm=False) as w:
        assert not w.data_port_active  # none offered: streams
        assert w.sessions[0].reply.data_port == 0
    on = serve(tiny_model(), policy="async")
    assert on.data is not None and on.data.port > 0
    with ps.Worker(on.address, tiny_model()) as w:  # same host: the segment, no port
        assert w.shm_active and w.sessions[0].reply.data_port == 0
    with pytest.raises(ConfigError, match="--data-port"):
        ps.serve(tiny_model(), port=0, data_port="fifty")
    with pytest.raises(ConfigError, match="Cannot serve the data port"):  # taken: say so
        ps.serve(tiny_model(), port=0, host="127.0.0.1", data_port=str(on.data.port))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("no data port")]
    assert said == [f"no data port on 127.0.0.1:{on.data.port}: Address already in use"]
    assert host_of("[::1]:5") == "::1" and host_of("ps-0.ps:50051") == "ps-0.ps"


def _raw(server: ps.ServerApp) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.data.port), timeout=DEADLINE)
    sock.settimeout(DEADLINE)
    return sock


def _refused(sock: socket.socket) -> grpc.StatusCode:
    """The code of the one failure frame the server answers before it closes."""
    frame = records.recv(sock)
    assert frame is not None and frame.code != records.OK
    assert records.recv(sock) is None  # then it closes the connection
    with pytest.raises(records.ControlError) as err:
        records.raise_for(frame)
    return err.value.code()


def test_a_hello_without_the_token_or_the_joins_nonce_is_refused(serve):
    server = serve(tiny_model(), policy="async", security=Security(token=TOKEN))
    with ps.Worker(server.address, tiny_model(), shm=False, security=Security(token=TOKEN)) as w:
        assert w.data_port_active
        nonce, wid = w.sessions[0].reply.data_nonce, w.worker_id
        hellos = {
            "no token": records.data_hello(None, nonce, wid),
            "wrong token": records.data_hello("wrong", nonce, wid),
            "wrong nonce": records.data_hello(TOKEN, bytes(len(nonce)), wid),
            "another worker": records.data_hello(TOKEN, nonce, "nobody"),
        }
        for why, hello in hellos.items():
            with _raw(server) as sock:
                records.send(sock, records.Frame(hello))
                assert _refused(sock) == grpc.StatusCode.UNAUTHENTICATED, why
        for garbage in (b"", b"\xff\xff", b"\x00\x00" + b"x" * 8):
            with _raw(server) as sock:
                records.send(sock, records.Frame(garbage))
                assert _refused(sock) == grpc.StatusCode.INVALID_ARGUMENT, garbage
        with _raw(server) as sock:  # a hello past the limit is refused unread
            sock.sendall(records.HEADER.pack(1 << 30, 0, 0.0, 0))
            assert _refused(sock) == grpc.StatusCode.INVALID_ARGUMENT
        assert w.data_port_active  # none of them took the worker's connection
        for p in w.model.parameters():
            p.grad = torch.ones_like(p)
        w.step(samples=1)
    assert server.status()["version"] == 1
    assert server.data.refusals.counts["hello Unauthenticated"] == len(hellos)


def test_both_ends_of_a_data_connection_probe_a_quiet_link(serve):
    """Keepalive: a step blocked on a dead link fails within about a minute, not at its
    deadline; a worker that vanished frees its server thread."""
    server = serve(tiny_model(), policy="async")
    with ps.Worker(server.address, tiny_model(), shm=False) as w:
        sock = w.sessions[0].channel.payloads.data.sock
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 20
        (conn,) = server.data._workers.values()
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3


def test_a_peer_that_sends_no_hello_is_refused_at_its_deadline(serve):
    server = serve(tiny_model(), policy="async")
    server.data.hello_seconds = 0.3
    with _raw(server) as sock:
        assert _refused(sock) == grpc.StatusCode.DEADLINE_EXCEEDED
    with _raw(server) as sock:  # half a hello, then nothing
        sock.sendall(records.HEADER.pack(40, 0, 0.0, 0) + b"x" * 10)
        assert _refused(sock) == grpc.StatusCode.DEADLINE_EXCEEDED


def _step(worker: ps.Worker, **header) -> pb.PushPullRequest:
    fields = {
        "worker_id": worker.worker_id,
        "iteration": worker.clock,
        "incarnation": worker.incarnation,
        "samples": 1,
        "total_bytes": worker.manifest.total_bytes,
        **header,
    }
    return pb.PushPullRequest(push=pb.PushHeader(**fields))


def test_a_step_that_lies_about_its_size_is_refused_before_its_bulk_is_read(serve):
    server = serve(tiny_model(), policy="async")
    with ps.Worker(server.address, tiny_model(), shm=False, overlap=False) as w:
        nbytes = w.manifest.total_bytes
        lies = {
            "header off the model": (_step(w, total_bytes=nbytes - 4), nbytes - 4),
            "bulk off the header": (_step(w), nbytes - 4),
            "a huge bulk": (_step(w), 1 << 40),
            "a pull with bulk": (pb.PushPullRequest(pull=pb.PullRequest(worker_id=w.worker_id)), 8),
            "a step in shared memory": (_step(w, shm=True, total_bytes=0), 0),
        }
        for why, (request, bulk) in lies.items():
            # the worker's own nonce: this connection replaces the worker's
            nonce = w.sessions[0].reply.data_nonce
            data = DataSocket("127.0.0.1", server.data.port, Security(), w.worker_id, nonce, 5.0)
            frame = records.Frame(request.SerializeToString(), seconds=DEADLINE, bulk=bulk)
            data.sock.sendall(records.encode(frame))  # the header alone: nothing follows
            assert _refused(data.sock) == grpc.StatusCode.INVALID_ARGUMENT, why
            data.close()
        assert server.status()["version"] == 0
        # the worker's connection was replaced: its next steps go over gRPC, and count
        for p in w.model.parameters():
            p.grad = torch.ones_like(p)
        w.step(samples=1)
        assert not w.data_port_active
    assert server.status()["version"] == 1


def test_a_step_whose_pull_is_refused_applies_nothing_of_its_push(serve):
    """Issue 55, defect 11: a step whose push was well-formed but whose pull was not (int8
    weights, which pulls never carry) was refused after its push was applied, so the
    worker could not know its push counted. A step is checked whole first: refused, it
    leaves the model and the worker's clock as they were, and a retry done right counts."""
    server = serve(tiny_model(), policy="async")
    with ps.Worker(server.address, tiny_model(), shm=False, overlap=False) as w:
        nbytes = w.manifest.total_bytes
        ones = torch.ones(nbytes // 4).numpy().tobytes()

        def pull(**fields) -> pb.PullRequest:
            ids = {"worker_id": w.worker_id, "incarnation": w.incarnation}
            return pb.PullRequest(**{**ids, "iteration": w.clock + 1, **fields})

        bad_pulls = {
            "int8 weights": pull(dtype="int8"),
            "an exact tail past the weights": pull(dtype="bfloat16", exact=nbytes),
            "the pushed iteration again": pull(iteration=w.clock),
            "a pull of another incarnation": pull(incarnation="0123456789ab"),
            "too many batches": pull(batches=5000),
            "a negative count of batches": pull(batches=-1),
            "a pull far past its push": pull(iteration=w.clock + 10),
        }
        for why, bad in bad_pulls.items():
            nonce = w.sessions[0].reply.data_nonce
            data = DataSocket("127.0.0.1", server.data.port, Security(), w.worker_id, nonce, 5.0)
            request = _step(w)
            request.pull.CopyFrom(bad)
            frame = records.Frame(request.SerializeToString(), seconds=DEADLINE, bulk=nbytes)
            data.sock.sendall(records.encode(frame) + ones)
            answer = records.recv(data.sock)
            assert answer is not None and answer.code != records.OK, why
            with pytest.raises(records.ControlError) as err:
                records.raise_for(answer)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, why
            data.close()
            status = server.status()
            assert status["version"] == 0, f"{why}: its push was applied"
            assert server.coordinator.membership.get(w.worker_id).clock == 0, why
        for p in w.model.parameters():
            p.grad = torch.ones_like(p)
        w.step(samples=1)  # the worker's own next step: its push counts once
    assert server.status()["version"] == 1


def _bn() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    model[1].num_batches_tracked.fill_(1001)  # bfloat16 would make it 1000
    return model


@pytest.mark.parametrize("wire", ["grpc", "auto"])
@pytest.mark.parametrize("compress", ["fp16", "bf16"])
def test_16_bit_pulls_carry_rounded_weights_and_exact_counts(serve, wire, compress, monkeypatch):
    """With --compress, a pull carries a 16-bit copy of the server's float32 masters (half
    the bytes), its integer buffers exact, over gRPC streams and the data port alike."""
    from paramserver.server.doors.payloads import Payloads

    sent: list[int] = []
    weights = Payloads.weights
    monkeypatch.setattr(
        Payloads, "weights", lambda *a: sent.append((out := weights(*a)).nbytes) or out
    )
    model = _bn()
    server = serve(replica(model), optimizer="sgd", lr=0.1, policy="sync")
    mine = replica(model)
    mine[1].num_batches_tracked.zero_()
    with ps.Worker(server.address, mine, shm=False, wire=wire, compress=compress) as w:
        assert w.data_port_active is (wire == "auto")
        for _ in range(3):
            mine(torch.randn(8, 6)).square().mean().backward()
            w.step(samples=8)
        numel = w.manifest.numel
    assert sent and set(sent) == {2 * (numel - 1) + 4}  # 16 bits, but the count
    masters = torch.from_numpy(server.coordinator.store.weights.copy())
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}[compress]
    got = torch.cat([p.detach().flatten() for p in mine.parameters()])
    n = got.numel()
    assert torch.equal(got, masters[:n].to(half).float())  # rounded copies of the masters
    assert not torch.equal(got, masters[:n])
    assert mine[1].num_batches_tracked.item() == masters[-1].item() == 1004


@pytest.mark.parametrize("wire", ["auto", "grpc"])
def test_blocking_pulls_over_the_wire_land_in_the_model_itself(serve, wire):
    """No copy after a pull: the model's tensors are views of the buffer the weights are
    received into, on the data port and on gRPC streams alike."""
    model = tiny_model()
    server = serve(replica(model), optimizer="sgd", lr=0.01, policy="async", workers=1)
    with ps.Worker(server.address, model, shm=False, overlap=False, wire=wire) as worker:
        assert worker.data_port_active is (wire == "auto")
        weights = worker.sessions[0].channel.weights
        span = (weights.data_ptr(), weights.data_ptr() + weights.nbytes)
        assert all(span[0] <= p.data_ptr() < span[1] for p in model.parameters())
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            worker.step(samples=1)
            got = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
            assert (got == server.coordinator.store.weights).all()
        assert server.status()["version"] == 2


@pytest.mark.parametrize("skip", [False, True])
def test_a_non_finite_gradient_found_while_it_arrives_is_refused_or_skipped(serve, skip):
    """The data port checks a push's bytes piece by piece as they arrive: a NaN anywhere is
    found (refused, or skipped and counted with --skip-nonfinite), as on every other path."""
    model = tiny_model()
    server = serve(replica(model), optimizer="sgd", lr=0.1, policy="async", skip_nonfinite=skip)
    with ps.Worker(server.address, model, shm=False, overlap=False) as worker:
        assert worker.data_port_active
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        last = list(model.parameters())[-1]
        last.grad.view(-1)[-1] = float("nan")  # the very last element of the push
        if skip:
            worker.step(samples=1)
            assert (server.status()["pushes_skipped"], server.status()["version"]) == (1, 0)
        else:
            with pytest.raises(ps.ParamServerError, match="NaN or Inf"):
                worker.step(samples=1)
            assert server.status()["version"] == 0


def _batchnorm_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(784, 600),  # 1.8 MiB of weight: sent as itself; the rest in runs
        torch.nn.BatchNorm1d(600),
        torch.nn.ReLU(),
        torch.nn.Linear(600, 10),
    )


def _flat(model: torch.nn.Module, manifest, role: str) -> torch.Tensor:
    """The ``role`` section of the flat buffer as the worker holds it: the parameters'
    gradients ("param") or the buffers' values ("buffer"), in the manifest's order."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    state = model.state_dict()
    return torch.cat(
        [
            (grads[s.name] if role == "param" else state[s.name]).detach().flatten().float()
            for s in sorted(manifest.tensors, key=lambda s: s.offset)
            if s.role == role
        ]
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_a_push_sent_from_the_gradients_themselves_trains_as_a_copied_one(
    serve, monkeypatch, overlap
):
    """On the data port a push goes out from the gradients (and copies of the buffers'
    values, which the next forward pass changes) instead of a copy in the push slot; it
    trains as gRPC streams do, with the pushes in flight while the next batch computes
    (overlap on), and when the port fails mid-run the staged push goes over gRPC whole.

    Overlap on under delay-1, whether a pull already holds the push before it is timing
    (a loaded machine changes it), so there every push the server applied is checked
    against the gradients and buffers the worker had at that step; overlap off, the two
    runs are equal to the bit."""
    from paramserver.server.bookkeeping.store import ParameterStore as Store
    from paramserver.transport import tcp

    sent: list[int] = []
    real = tcp.segments
    monkeypatch.setattr(tcp, "segments", lambda p, s: sent.append(len(p)) or real(p, s))
    applied: list[torch.Tensor] = []  # each gradient the server stepped with
    shared: list[torch.Tensor] = []  # each push's buffers, as the server took them
    real_step, real_set = Store.step, Store.set_buffers

    def stepping(store, grad, *args, **kwargs):
        applied.append(torch.from_numpy(np.array(grad, copy=True)))
        return real_step(store, grad, *args, **kwargs)

    def setting(store, values):
        lo, hi = store.manifest.section("buffer")
        shared.append(torch.from_numpy(np.array(values[: hi - lo], copy=True)))
        return real_set(store, values)

    monkeypatch.setattr(Store, "step", stepping)
    monkeypatch.setattr(Store, "set_buffers", setting)
    start = _batchnorm_model()
    runs = {}
    for wire in ("grpc", "auto"):
        applied.clear(), shared.clear()
        pushed: list[tuple[torch.Tensor, torch.Tensor]] = []
        server = serve(replica(start), optimizer="sgd", lr=0.1, policy="delay-1")
        model = replica(start)
        ds = data.synthetic(train=256, test=16)
        with ps.Worker(server.address, model, shm=False, overlap=overlap, wire=wire) as w:
            assert w.data_port_active is (wire == "auto")
            for step in range(10):
                if step == 6 and wire == "auto":  # the port fails: the rest goes over gRPC
                    w.sessions[0].channel.payloads.data.sock.shutdown(socket.SHUT_RDWR)
                idx = data.batch_indices(len(ds.train_x), 0, 16, step)
                F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx]).backward()
                pushed.append(
                    (_flat(model, w.manifest, "param"), _flat(model, w.manifest, "buffer"))
                )
                w.step(samples=len(idx))
            assert wire == "grpc" or not w.data_port_active
            w.flush()
        assert server.status()["pushes_applied"] == 10
        assert len(applied) == len(shared) == 10
        for k, (grad, buffers, (want_grad, want_buffers)) in enumerate(
            zip(applied, shared, pushed, strict=True)
        ):
            assert torch.equal(grad, want_grad), (wire, k)
            assert torch.equal(buffers, want_buffers), (wire, k)
        runs[wire] = {k: v.clone() for k, v in model.state_dict().items()}
    # 6 gradients and 3 buffers a push, until the port failed
    assert 5 <= len(sent) <= 7 and all(n == 9 for n in sent), sent
    if not overlap:
        for name, tensor in runs["grpc"].items():
            assert torch.equal(runs["auto"][name], tensor), name
