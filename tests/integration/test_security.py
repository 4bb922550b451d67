"""Mutual TLS with certificates made at test time, and the shared token."""

from __future__ import annotations

import datetime
import ipaddress
import socket
from pathlib import Path

import grpc
import pytest
import torch
import torch.nn.functional as F
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import paramserver as ps
from paramserver._proto import paramserver_pb2 as pb
from paramserver._proto import paramserver_pb2_grpc as pb_grpc
from paramserver.codec import records
from paramserver.config import Security
from paramserver.errors import ServerUnavailable, Unauthenticated
from paramserver.transport.security import client_channel
from paramserver.transport.tcp import DataSocket
from tests.conftest import DEADLINE, replica, tiny_model


def _issue(name: str, issuer_key, issuer_name, ca: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(folder: Path, stem: str, key, cert) -> tuple[str, str]:
    key_path, cert_path = folder / f"{stem}.key", folder / f"{stem}.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """A CA, a server and a client certificate it signed, and a client it did not sign."""
    folder = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _issue("test-ca", None, None, ca=True)
    out = {"ca": _write(folder, "ca", ca_key, ca_cert)}
    for stem in ("server", "client"):
        out[stem] = _write(folder, stem, *_issue(stem, ca_key, ca_cert.subject))
    out["stranger"] = _write(folder, "stranger", *_issue("stranger", None, None))
    return out


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
