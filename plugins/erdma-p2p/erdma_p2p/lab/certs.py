"""A certificate authority and a TURN server certificate for the NAT bed's coturn (TURN over TLS): made with
``cryptography`` at the bed's start, in its folder. ``write(folder, ip)`` writes ``turn-ca.pem`` (what a rank
trusts: ``traversal.stun.relay_ca``), ``turn-cert.pem`` and ``turn-key.pem`` (coturn's ``--cert``/``--pkey``),
the certificate naming ``ip`` (an IP address subject alternative name: ranks check the server they dialled)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


def _signed(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
            extension: x509.ExtensionType, critical: bool) -> x509.Certificate:
    """A certificate for ``subject``'s ``key``, valid from 5 minutes ago for 2 days, signed by ``signer``."""
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(extension, critical=critical).sign(signer, hashes.SHA256()))


def authority(folder: Path, stem: str = "turn-ca") -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new CA, its certificate written to ``folder/STEM.pem``."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _signed(stem, key, _name(stem), key, x509.BasicConstraints(ca=True, path_length=0), True)
    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def write(folder: Path, ip: str) -> Path:
    """The CA and coturn's certificate and key for ``ip``, in ``folder``; the CA's file."""
    ca_key, ca = authority(folder)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _signed("turn", key, ca.subject, ca_key,
                   x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), False)
    (folder / "turn-cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "turn-key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                            serialization.PrivateFormat.TraditionalOpenSSL,
                                                            serialization.NoEncryption()))
    return folder / "turn-ca.pem"
