"""What a rank presents and accepts on QUIC: its certificate, the job's CA, the aioquic configuration of
each connection, and the check of a dialling peer's certificate (``credentials`` makes and checks them).

``load(opts, rank, job)`` picks the credentials the config names: CA files (``erdma keys init``), a shared
secret, or (insecure development mode) none at all."""

from __future__ import annotations

import logging
import ssl
import warnings
from pathlib import Path
from typing import Any

from aioquic.quic.configuration import QuicConfiguration
from aioquic.tls import CipherSuite
from cryptography import x509

from erdma_core.sdk import ConfigError

from . import credentials as cred
from .endpoint import datagram_size
from .mesh import Ticket
from .streams import ALPNS

log = logging.getLogger("erdma.quic")
ALPN = ALPNS["aioquic"]
CIPHERS = {
    "aes128gcm": CipherSuite.AES_128_GCM_SHA256,
    "aes256gcm": CipherSuite.AES_256_GCM_SHA384,
    "chacha20": CipherSuite.CHACHA20_POLY1305_SHA256,
}


class Tls:
    """``configure`` and ``identify``, the two things the connection logic (``mesh``) asks of credentials."""

    def __init__(self, opts: dict[str, Any], creds: cred.RankCredentials, ca_pem: bytes, verify: bool, job: int,
                 window: int, part_bytes: int) -> None:
        self.opts, self.creds, self.ca_pem, self.verify, self.job = opts, creds, ca_pem, verify, job
        self.window, self.part_bytes = window, part_bytes

    def configure(self, client: bool, addr: Any, peer: int | None, ticket: Ticket | None) -> QuicConfiguration:
        """A connection's configuration: as the dialler (checking the listener is ``peer``, resuming with
        ``ticket`` when there is one) or as the listener (asking the dialler for its certificate)."""
        o = self.opts
        cipher = CIPHERS[o["cipher"]]
        c = QuicConfiguration(
            is_client=client, alpn_protocols=[ALPN], idle_timeout=o["idle_timeout"],
            max_datagram_size=datagram_size(addr, o["datagram_size"]),
            max_data=max(4 * self.window, 16 << 20), max_stream_data=max(2 * self.part_bytes, 1 << 20),
            congestion_control_algorithm=o["congestion_control"],
            cipher_suites=[cipher, *[c for c in CIPHERS.values() if c != cipher]],
            verify_mode=ssl.CERT_REQUIRED if self.verify else ssl.CERT_NONE,
            server_name=cred.identity(self.creds.names_key, peer, self.job) if peer is not None else None,
            session_ticket=ticket,
        )
        c.certificate = self.creds.cert
        c.private_key = self.creds.key
        c.cadata = self.ca_pem
        return c

    def identify(self, cert: x509.Certificate | None, chain: list[x509.Certificate], allowed: set[int]) -> int:
        """The rank a dialling peer's certificate proves it is; ``credentials.CredentialError`` otherwise."""
        return cred.check_peer(cert, chain, self.ca_pem, self.job, allowed, self.creds.names_key)


def load(opts: dict[str, Any], rank: int, job: int) -> Tls:
    """The credentials ``opts`` (the ``[transport.quic]`` section) select, as a ``Tls``."""
    verify = True
    if opts["insecure_dev_mode"]:
        msg = (f"rank {rank}: transport.quic.insecure_dev_mode is on: peers are NOT authenticated; anyone "
               "who can reach this port can join the job or read its data. Development only.")
        warnings.warn(msg, stacklevel=3)
        log.warning("%s", msg)
        verify = False
        ca = cred.new_authority("eRDMA insecure dev CA")
    elif opts["secret"]:
        ca = cred.derived_authority(opts["secret"].encode(), job)
    else:
        cert_path, key_path = _ca_files(opts)
        try:
            ca = cred.read_authority(cert_path, key_path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"transport.quic: cannot use the CA {cert_path} / {key_path}: {exc}") from None
    return Tls(opts, cred.issue(ca, rank, job), ca.pem, verify, job, int(opts["send_window_bytes"]),
               int(opts["part_bytes"]))


def _ca_files(opts: dict[str, Any]) -> tuple[Path, Path]:
    if opts["ca_cert"] or opts["ca_key"]:
        if not (opts["ca_cert"] and opts["ca_key"]):
            raise ConfigError("transport.quic.ca_cert and transport.quic.ca_key go together; "
                              f"got ca_cert={opts['ca_cert']!r}, ca_key={opts['ca_key']!r}")
        return Path(opts["ca_cert"]), Path(opts["ca_key"])
    d = cred.default_dir()
    if (d / "ca.pem").exists() and (d / "ca.key").exists():
        return d / "ca.pem", d / "ca.key"
    raise ConfigError(
        "transport 'quic' needs credentials and found none: run `erdma keys init` (writes "
        f"{d}/ca.pem and ca.key; share them with every host of the cluster), or set "
        "transport.quic.ca_cert and transport.quic.ca_key, or a shared secret on every rank: the job's "
        "(security.secret, or ERDMA_SECRET in the environment; `erdma run` makes one per job) or QUIC's own "
        "(transport.quic.secret / ERDMA_TRANSPORT_QUIC_SECRET); credentials are then derived per job. "
        "transport.quic.insecure_dev_mode = true turns authentication off (development only)")
