"""Real frameworks against one real gateway: the embedded model, served over TLS by the gateway
itself (`ssl_certfile` / `ssl_keyfile`) with a certificate of a CA made here, which every client
trusts the way its users would (httpx's `verify` for the Python SDK and the frameworks built on
it, `NODE_EXTRA_CA_CERTS` for Node). One server for the whole directory: the model loads once."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.server.app import create_app
from gateway.server.runner import ServerThread
from gateway.settings import Settings
from gateway.testing.images import data_url, photo_bytes

MiB = 1024 * 1024
API_KEY = "framework-key"


@dataclass(frozen=True)
class LocalCA:
    ca_pem: Path  # what clients trust
    cert_pem: Path  # the server's chain, for 127.0.0.1 and localhost
    key_pem: Path

    def context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_pem))


def make_ca(folder: Path) -> LocalCA:
    """A self-signed CA and a server certificate it signed (EC P-256, valid for a day)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("visiongate test CA"))
        .issuer_name(name("visiongate test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    out = LocalCA(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    out.ca_pem.write_bytes(ca.public_bytes(pem))
    out.cert_pem.write_bytes(cert.public_bytes(pem))
    out.key_pem.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return out


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> LocalCA:
    return make_ca(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def tls_gateway(test_ca: LocalCA) -> Iterator[ServerThread]:
    """The real gateway over TLS, with an API key (the clients send it as they would to
    OpenAI). Answers are capped at 96 tokens, room for a tool call or a small JSON object."""
    settings = Settings.load(
        dict(
            api_keys=[API_KEY],
            max_output_tokens=96,
            max_image_bytes=2 * MiB,
            max_pixels=4_000_000,
            cache_dir=os.environ.get("VISIONGATE_CACHE_DIR"),
            ssl_certfile=str(test_ca.cert_pem),
            ssl_keyfile=str(test_ca.key_pem),
        ),
        environ={},
    )
    with ServerThread(create_app(settings), settings) as server:
        server.wait_ready(verify=test_ca.context())
        yield server


@pytest.fixture(scope="session")
def base_url(tls_gateway: ServerThread) -> str:
    assert tls_gateway.http_url.startswith("https://")
    return f"{tls_gateway.http_url}/v1"


@pytest.fixture(scope="session")
def https_client(test_ca: LocalCA) -> Iterator[httpx.Client]:
    """What the Python clients send through: httpx trusting the test CA only."""
    with httpx.Client(verify=test_ca.context(), timeout=300) as client:
        yield client


@pytest.fixture(scope="session")
def async_https_client(test_ca: LocalCA) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=test_ca.context(), timeout=300)


@pytest.fixture(scope="session")
def model_id(base_url: str, https_client: httpx.Client) -> str:
    reply = https_client.get(f"{base_url}/models", headers={"Authorization": f"Bearer {API_KEY}"})
    return reply.json()["data"][0]["id"]


@pytest.fixture(scope="session")
def photo_url() -> str:
    """A real photo as a data URL (a size no other directory sends)."""
    return data_url(photo_bytes("coffee", size=224))
