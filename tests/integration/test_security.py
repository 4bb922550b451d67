"""Mutual TLS with certificates made at test time, and the shared token."""

from __future__ import annotations

import socket

import grpc
import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver._proto import paramserver_pb2 as pb
from paramserver._proto import paramserver_pb2_grpc as pb_grpc
from paramserver.codec import records
from paramserver.config import Security
from paramserver.errors import ServerUnavailable, Unauthenticated
from paramserver.transport.security import client_channel
from paramserver.transport.tcp import DataSocket
from tests.conftest import DEADLINE, replica, tiny_model


def _one_step(address: str, model, connect_timeout: float = 5, **kwargs) -> int:
    with ps.Worker(address, model, connect_timeout=connect_timeout, **kwargs) as w:
        x = torch.randn(4, 1, 28, 28)
        F.cross_entropy(model(x), torch.tensor([0, 1, 2, 3])).backward()
        w.step(samples=4)
        return w.version


def test_mutual_tls_admits_only_clients_with_a_certificate_from_the_ca(serve, pki):
    ca = pki["ca"][0]
    server_sec = Security(cert=pki["server"][0], key=pki["server"][1], ca=ca)
    model = tiny_model()
    server = serve(replica(model), policy="async", security=server_sec)

    client = Security(cert=pki["client"][0], key=pki["client"][1], ca=ca)
    assert _one_step(server.address, replica(model), security=client) == 1

    for who in (
        Security(ca=ca),  # TLS, but no client certificate
        Security(cert=pki["stranger"][0], key=pki["stranger"][1], ca=ca),  # not signed by the CA
        Security(),  # plain text
    ):
        with pytest.raises(ServerUnavailable):
            _one_step(server.address, replica(model), security=who, connect_timeout=2)
    assert server.status()["version"] == 1
    assert server.status()["workers_joined"] == 1


def test_calls_without_the_token_are_refused_and_change_nothing(serve):
    model = tiny_model()
    server = serve(replica(model), policy="async", security=Security(token="s3cret"))
    for sec in (Security(), Security(token="wrong")):
        channel = client_channel(server.address, sec, [])
        stub = pb_grpc.ParameterServerStub(channel)
        calls = [
            (stub.Join, pb.JoinRequest(name="intruder")),
            (stub.Status, pb.StatusRequest()),
            (lambda r, timeout, s=stub: list(s.Pull(r, timeout=timeout)), pb.PullRequest()),
            (stub.Push, iter([pb.PushChunk(header=pb.PushHeader(worker_id="x"))])),
            (stub.Heartbeat, pb.HeartbeatRequest(worker_id="x")),
            (stub.Leave, pb.LeaveRequest(worker_id="x")),
        ]
        for method, request in calls:
            with pytest.raises(grpc.RpcError) as err:
                method(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            why = err.value.details()
            # the real cause, in words for any client, never the token itself
            assert ("does not match" if sec.token else "carried none") in why
            assert "worker" not in why and "wrong" not in why and "s3cret" not in why
        channel.close()
        with pytest.raises(Unauthenticated):
            _one_step(server.address, replica(model), security=sec)
    status = server.status()
    assert (status["version"], status["workers_joined"]) == (0, 0)

    assert _one_step(server.address, replica(model), security=Security(token="s3cret")) == 1


def test_the_data_port_speaks_the_servers_tls_and_refuses_who_fails_it(serve, pki):
    """A worker with a client certificate steps over the data port in TLS; a plain-text
    peer and TLS peers without a certificate the CA signed fail the handshake: nothing
    they send is read, and nothing changes."""
    ca = pki["ca"][0]
    server_sec = Security(cert=pki["server"][0], key=pki["server"][1], ca=ca)
    model = tiny_model()
    server = serve(replica(model), policy="async", security=server_sec)
    client = Security(cert=pki["client"][0], key=pki["client"][1], ca=ca)
    mine = replica(model)
    with ps.Worker(server.address, mine, security=client, shm=False) as w:
        assert w.data_port_active
        for p in mine.parameters():
            p.grad = torch.ones_like(p)
        w.step(samples=1)
        port, nonce = server.data.port, w.sessions[0].reply.data_nonce
        hello = records.Frame(records.data_hello(None, nonce, w.worker_id))
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as plain:
            plain.sendall(records.encode(hello))
            with pytest.raises((OSError, records.ControlError)):
                records.raise_for(records.recv(plain) or records.Frame(b"closed", 14))
        for who in (
            Security(ca=ca),  # TLS, but no client certificate
            Security(cert=pki["stranger"][0], key=pki["stranger"][1], ca=ca),  # not the CA's
        ):
            with pytest.raises(OSError):
                DataSocket("127.0.0.1", port, who, w.worker_id, nonce, DEADLINE)
        assert w.data_port_active  # none of them took its connection
        w.step(samples=1)
    assert server.status()["version"] == 2
    assert server.data.refusals.counts["handshake failed"] == 3
