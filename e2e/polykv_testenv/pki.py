"""Generated PKI for a loopback control plane: one CA, the API server's serving certificate,
an admin client certificate and the service-account signing key."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The first address of --service-cluster-ip-range: in-cluster clients use it for
# "kubernetes.default", so the serving certificate names it too.
SERVICE_IP = "10.0.0.1"
SERVICE_CIDR = "10.0.0.0/24"
FRONT_PROXY_CN = "front-proxy-client"

_VALIDITY = dt.timedelta(days=365)


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path
    front_proxy_ca: Path
    front_proxy_cert: Path
    front_proxy_key: Path


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    path.write_bytes(pem)
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    usages: list[x509.ObjectIdentifier] | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=not ca,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


Issuer = tuple[x509.Name, ec.EllipticCurvePrivateKey]


def _ca(cn: str, cert_path: Path, key_path: Path | None) -> Issuer:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(cn)
    _write_cert(cert_path, _issue(name, key, name, key, ca=True))
    if key_path is not None:
        _write_key(key_path, key)
    return name, key


def _leaf(
    subject: x509.Name,
    issuer: Issuer,
    paths: tuple[Path, Path],
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName] | None = None,
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue(subject, key, issuer[0], issuer[1], usages=[usage], sans=sans)
    _write_cert(paths[0], cert)
    _write_key(paths[1], key)


def generate(directory: Path) -> Pki:
    """Writes a fresh PKI into `directory` and returns the file paths."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
        front_proxy_ca=directory / "front-proxy-ca.crt",
        front_proxy_cert=directory / "front-proxy-client.crt",
        front_proxy_key=directory / "front-proxy-client.key",
    )
    ca = _ca("polykv-dev-ca", pki.ca_cert, pki.ca_key)
    dns = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", SERVICE_IP)]
    _leaf(
        _name("kube-apiserver"),
        ca,
        (pki.serving_cert, pki.serving_key),
        ExtendedKeyUsageOID.SERVER_AUTH,
        sans,
    )
    # Group system:masters is bound to cluster-admin and bypasses RBAC entirely.
    _leaf(
        _name("polykv-admin", "system:masters"),
        ca,
        (pki.admin_cert, pki.admin_key),
        ExtendedKeyUsageOID.CLIENT_AUTH,
    )
    # The request-header (front proxy) CA: the controller manager and scheduler log errors
    # in a loop without it, and aggregated APIs (metrics-server) need it.
    fp_ca = _ca("polykv-dev-front-proxy-ca", pki.front_proxy_ca, None)
    _leaf(
        _name(FRONT_PROXY_CN),
        fp_ca,
        (pki.front_proxy_cert, pki.front_proxy_key),
        ExtendedKeyUsageOID.CLIENT_AUTH,
    )

    # RSA: every service-account token verifier understands RS256.
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


# -- certificates for servers under test (an aggregated API's serving pair, client pairs) --


@dataclass(frozen=True)
class Authority:
    cert: Path
    key: Path


def authority(directory: Path, name: str) -> Authority:
    """A fresh CA: `<name>-ca.crt` and `<name>-ca.key` in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    found = Authority(directory / f"{name}-ca.crt", directory / f"{name}-ca.key")
    _ca(f"polykv-dev-{name}-ca", found.cert, found.key)
    return found


def leaf(
    ca: Authority, directory: Path, name: str, cn: str, dns: tuple[str, ...] = ()
) -> tuple[Path, Path]:
    """A certificate `ca` signs for `cn` (server auth for the `dns` names when given, else
    client auth): (`<name>.crt`, `<name>.key`) in `directory`."""
    key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    sans: list[x509.GeneralName] | None = [x509.DNSName(d) for d in dns] or None
    usage = ExtendedKeyUsageOID.SERVER_AUTH if dns else ExtendedKeyUsageOID.CLIENT_AUTH
    paths = (directory / f"{name}.crt", directory / f"{name}.key")
    _leaf(_name(cn), (ca_cert.subject, key), paths, usage, sans)
    return paths
