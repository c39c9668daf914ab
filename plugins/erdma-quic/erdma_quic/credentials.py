"""Who may join a job: a cluster CA, per-rank certificates that bind (job, rank), and their checks.

Two ways to hold the cluster credential:

* **CA files** (``erdma keys init``): ``ca.pem`` and ``ca.key``. Every rank signs itself a short-lived
  certificate for its own identity at start-up; whoever holds ``ca.key`` can join, so it is the cluster's
  secret and is written with mode 0600.
* **A shared secret**: the CA's key is derived from the secret *and the job id* (HKDF-SHA256), so every job
  has its own CA and a certificate from another job, or from a holder of another secret, fails the chain check.

A rank's certificate names it ``n<32 hex>.erdma`` (subjectAltName and common name): an HMAC of its rank and
the job id under a key derived from the CA's private key (``Authority.names_key``), which every rank holds and
no stranger does. A listener shows its certificate to whoever starts a handshake, before that peer proved
anything; the name tells such a peer neither the job nor the rank (nor does the CA's: a CA derived from a
secret is named "eRDMA job CA", whatever the job). A dialling rank checks the listener's chain and the name
of the rank it meant to reach; the listener checks the dialler's chain and that its name is one of the ranks
that dial it, once the handshake ends, before it reads a byte from it. Both refuse, with the reason, anything
else.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
import os
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import NameOID

_CURVE = ec.SECP256R1()
_EPOCH = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
_FAR = datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC)


class CredentialError(Exception):
    """A peer's certificate is missing, from another CA or names another identity."""


@functools.lru_cache(maxsize=4096)  # (a listener checks a dialler's name against every rank that may dial it)
def identity(names_key: bytes, rank: int, job: int) -> str:
    """The name rank ``rank`` of job ``job`` carries in its certificate: only a holder of ``names_key`` (the
    CA's, ``Authority.names_key``) can tell which rank and job it stands for."""
    said = f"r{rank}.j{job & 0xFFFFFFFFFFFFFFFF:016x}".encode()
    return f"n{hmac.new(names_key, said, hashlib.sha256).hexdigest()[:32]}.erdma"


@attrs.frozen
class Authority:
    """A CA that can issue rank certificates."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def names_key(self) -> bytes:
        """The key rank names are made with (``identity``): derived from this CA's private key, so the same on
        every holder of it."""
        secret = self.key.private_numbers().private_value.to_bytes(32, "big")
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"erdma-quic names v1", info=b"").derive(secret)


@attrs.frozen
class RankCredentials:
    """What one rank presents (certificate and key) and trusts (``ca_pem``)."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    ca_pem: bytes
    name: str
    names_key: bytes  # the CA's (``Authority.names_key``): what this rank names its peers with


def _ca_cert(key: ec.EllipticCurvePrivateKey, common_name: str, serial: int) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    return (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(serial).not_valid_before(_EPOCH).not_valid_after(_FAR)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))


def new_authority(common_name: str = "eRDMA cluster CA") -> Authority:
    key = ec.generate_private_key(_CURVE)
    return Authority(_ca_cert(key, common_name, x509.random_serial_number()), key)


def derived_authority(secret: bytes, job: int) -> Authority:
    """The same CA on every rank that knows ``secret``; a different one for every job."""
    okm = HKDF(algorithm=hashes.SHA256(), length=48, salt=b"erdma-quic ca v1",
               info=job.to_bytes(8, "little")).derive(secret)
    scalar = int.from_bytes(okm, "big") % (_curve_order() - 1) + 1
    key = ec.derive_private_key(scalar, _CURVE)
    serial = int.from_bytes(hashlib.sha256(okm).digest()[:16], "big") >> 1
    return Authority(_ca_cert(key, "eRDMA job CA", serial), key)  # (a stranger sees it: no job id in it)


def _curve_order() -> int:
    return 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551  # P-256


def issue(ca: Authority, rank: int, job: int, days: float = 7.0) -> RankCredentials:
    key = ec.generate_private_key(_CURVE)
    name = identity(ca.names_key, rank, job)
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=10)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
            .sign(ca.key, hashes.SHA256()))
    return RankCredentials(cert, key, ca.pem, name, ca.names_key)


# ---- files -----------------------------------------------------------------------------------------------
def default_dir() -> Path:
    return Path(os.environ.get("ERDMA_KEYS_DIR") or Path.home() / ".config" / "erdma" / "keys")


def write_authority(ca: Authority, folder: Path, force: bool = False) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / "ca.pem", folder / "ca.key"
    if not force and (cert_path.exists() or key_path.exists()):
        raise FileExistsError(f"{folder} already holds a CA (ca.pem / ca.key); pass --force to replace it")
    cert_path.write_bytes(ca.pem)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(ca.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    os.chmod(key_path, 0o600)
    return cert_path, key_path


def read_authority(cert_path: Path, key_path: Path) -> Authority:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path}: not an EC private key (made by `erdma keys init`?)")
    if key.public_key().public_numbers() != cert.public_key().public_numbers():  # type: ignore[union-attr]
        raise ValueError(f"{key_path} is not the key of {cert_path}")
    return Authority(cert, key)


# ---- checks ----------------------------------------------------------------------------------------------
def check_peer(cert: x509.Certificate | None, chain: list[x509.Certificate], ca_pem: bytes, job: int,
               allowed: set[int], names_key: bytes) -> int:
    """The rank a dialling peer proved it is; CredentialError when it proved nothing acceptable."""
    from aioquic.tls import AlertBadCertificate, AlertCertificateExpired, verify_certificate

    if cert is None:
        raise CredentialError("it presented no certificate")
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    except x509.ExtensionNotFound:
        names = []
    ranks = {identity(names_key, r, job): r for r in allowed}
    found = [ranks[n] for n in names if n in ranks]
    if not found:
        raise CredentialError(f"its certificate names none of the ranks {sorted(allowed)} of this job (subjectAltName "
                              f"{names}: a rank of another job, another rank, or another CA's)")
    rank = found[0]
    try:
        verify_certificate(cert, chain, server_name=identity(names_key, rank, job), cadata=ca_pem)
    except (AlertBadCertificate, AlertCertificateExpired) as exc:
        raise CredentialError(f"its certificate for rank {rank} does not verify against this job's CA: "
                              f"{exc}") from None
    return rank
