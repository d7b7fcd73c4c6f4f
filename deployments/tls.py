"""Mutual TLS on the internal services: each application's own certificate authority and the certificates it
issues, made with `cryptography` when the application is deployed, and the gRPC credentials built from them.

A worker serves only callers whose certificate its application's CA signed, and a router talks only to workers
whose certificate that CA signed: a process that never got the material (another application, anything else on
the network) cannot complete a handshake in either direction, and nothing crosses the network in clear. The
registry actor (`deployments.worker_registry`) makes the CA on first ask and issues every certificate; the CA's key
never leaves that actor.

Names: workers are dialled at "ip:port" addresses that change with every replica, so a server certificate cannot
name them. It names SERVER_NAME instead, and clients check a worker's certificate against that name
(`grpc.ssl_target_name_override`). What authenticates a worker is the CA that signed it: the name only has to match.

A mounted directory (a Kubernetes Secret as cert-manager writes one: ca.crt, tls.crt, tls.key) replaces the made
material (`load_dir`). Its one certificate serves both ends, so it must allow server and client authentication,
and the name clients expect is its first DNS name.
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from specdec_core.errors import InvalidArgument

SERVER_NAME = "workers.specdec.internal"  # the DNS name in every made worker certificate
# The material lives only in the registry actor's memory, with no rotation: a validity shorter than a cluster's life
# would stop the service the day it ran out. A new registry (a new cluster, `worker_registry.shutdown`) makes a new CA.
VALIDITY = datetime.timedelta(days=3650)
CLOCK_SKEW = datetime.timedelta(minutes=5)  # nodes' clocks disagree a little: a fresh certificate must be valid on all
DIR_FILES = ("ca.crt", "tls.crt", "tls.key")  # a Kubernetes TLS Secret's keys, plus the CA that cert-manager adds


class Role(enum.Enum):
    SERVER = "server"  # a worker: serves the internal services
    CLIENT = "client"  # a router, or a tool reading GetStats: calls them


@dataclass(frozen=True)
class TlsSetting:
    """An application's choice (`internal_tls`, `internal_tls_dir` in its config): TLS or plaintext, and where a
    mounted certificate directory is (None: certificates made by the registry)."""

    enabled: bool = True
    directory: str | None = None


@dataclass(frozen=True)
class Authority:
    """An application's CA: its certificate and its signing key (PEM). Held by the registry actor only."""

    cert: bytes
    key: bytes = field(repr=False)  # kept out of reprs, so out of any log line or error that prints the object


@dataclass(frozen=True)
class TlsBundle:
    """What one process presents and trusts: the CA (PEM), its own certificate and key (PEM), and the name clients
    expect in a worker's certificate."""

    ca: bytes
    cert: bytes
    key: bytes = field(repr=False)
    server_name: str = SERVER_NAME


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # P-256: small, fast handshakes, supported by every gRPC build


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    # Unencrypted PKCS#8: gRPC takes no passphrase. Keys stay in memory, or in a Secret the platform protects.
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specdec"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + VALIDITY)
    )


def make_authority(app: str) -> Authority:
    """A new CA for `app`. It signs leaf certificates only (path length 0): no intermediate can be made from it."""
    key = _new_key()
    name = _name(f"specdec {app} internal CA"[:64])  # a common name holds at most 64 characters
    cert = (
        _builder(name, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Authority(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def issue(authority: Authority, role: Role, app: str) -> TlsBundle:
    """A certificate and a fresh key for one process of `app`, signed by its CA. A worker's names SERVER_NAME and
    may only serve; a client's may only call (extended key usage), so neither can stand in for the other."""
    ca_cert = x509.load_pem_x509_certificate(authority.cert)
    ca_key = serialization.load_pem_private_key(authority.key, password=None)
    key = _new_key()
    builder = (
        _builder(_name(f"specdec {app} {role.value}"[:64]), ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
    )
    if role is Role.SERVER:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return TlsBundle(authority.cert, cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def load_dir(directory: str | Path) -> TlsBundle:
    """The material of a mounted directory (ca.crt, tls.crt, tls.key). Checked here, where a mistake can name the
    file, rather than in a handshake that fails with a bare UNAVAILABLE: the key is the certificate's, the
    certificate may both serve and call, and it has a DNS name for clients to expect."""
    root = Path(directory)
    missing = [name for name in DIR_FILES if not (root / name).is_file()]
    if missing:
        raise InvalidArgument("internal_tls_dir", f"{str(root)!r} lacks {', '.join(missing)}")
    ca, cert_pem, key_pem = ((root / name).read_bytes() for name in DIR_FILES)
    try:
        x509.load_pem_x509_certificates(ca)
        cert = x509.load_pem_x509_certificates(cert_pem)[0]  # tls.crt may carry its chain after it
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError as exc:
        raise InvalidArgument("internal_tls_dir", f"{str(root)!r}: unreadable PEM ({exc})") from None
    if _public(key.public_key()) != _public(cert.public_key()):
        raise InvalidArgument("internal_tls_dir", f"{str(root)!r}: tls.key is not the key of tls.crt")
    _check_usage(root, cert)
    return TlsBundle(ca, cert_pem, key_pem, _first_dns_name(root, cert))


def _public(public_key: object) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER,  # type: ignore[attr-defined]
        serialization.PublicFormat.SubjectPublicKeyInfo,
    )


def _check_usage(root: Path, cert: x509.Certificate) -> None:
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return  # no restriction: any use
    needed = {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    if not needed <= set(usage):
        raise InvalidArgument(
            "internal_tls_dir",
            f"{str(root)!r}: tls.crt must allow both server auth and client "
            "auth (workers serve with it, routers call with it)",
        )


def _first_dns_name(root: Path, cert: x509.Certificate) -> str:
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName
        )
    except x509.ExtensionNotFound:
        names = []
    if not names:
        raise InvalidArgument("internal_tls_dir", f"{str(root)!r}: tls.crt has no DNS name for clients to expect")
    return names[0]


def server_credentials(bundle: TlsBundle) -> grpc.ServerCredentials:
    """A worker's: its certificate, and a handshake that requires a client certificate signed by the CA."""
    return grpc.ssl_server_credentials(
        [(bundle.key, bundle.cert)], root_certificates=bundle.ca, require_client_auth=True
    )


def channel_credentials(bundle: TlsBundle) -> grpc.ChannelCredentials:
    """A client's: trust only the application's CA (not the system's roots), and present its own certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=bundle.ca, private_key=bundle.key, certificate_chain=bundle.cert
    )


def channel_options(bundle: TlsBundle) -> list[tuple[str, str]]:
    """Check a worker's certificate against the application's server name, not the address dialled."""
    return [("grpc.ssl_target_name_override", bundle.server_name)]
