"""Certificates for the TLS tests: a CA, a server and a client it signed, a stranger."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


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


def make_pki(folder: Path) -> dict[str, tuple[str, str]]:
    """A CA, a server and a client certificate it signed, and a client it did not sign:
    {name: (certificate path, key path)}."""
    ca_key, ca_cert = _issue("test-ca", None, None, ca=True)
    out = {"ca": _write(folder, "ca", ca_key, ca_cert)}
    for stem in ("server", "client"):
        out[stem] = _write(folder, stem, *_issue(stem, ca_key, ca_cert.subject))
    out["stranger"] = _write(folder, "stranger", *_issue("stranger", None, None))
    return out
