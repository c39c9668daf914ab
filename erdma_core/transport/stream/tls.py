"""TLS 1.3 on the TCP transport (``transport.tcp.tls``), from the standard library's ``ssl``.

The job's secret already proves who is at each end (``auth``); TLS adds secrecy and integrity on the path.
Each rank makes an ephemeral self-signed certificate (nobody checks its chain); instead, right after the TLS
handshake both ends send an HMAC, under the job's key, over the authenticated handshake's transcript and the
fingerprint of the certificate the accepting side presented, as each end saw it. A relay in the middle
that ends TLS on both sides shows the dialler its own certificate: the fingerprints differ, and so do the
proofs. ``TlsSocket`` gives the progress engine the calls it makes on a plain socket.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import socket
import ssl
import tempfile
import threading
from collections.abc import Sequence

from ...errors import AuthenticationError
from ...net.sockets import recv_exact
from ...security import auth

_DIAL, _ACCEPT = b"erdma-tls-dial", b"erdma-tls-accept"
_WRITE = 1 << 18  # bytes handed to TLS per write: what is left of a large frame is not copied again each time


def _head(views: Sequence[memoryview | bytes], limit: int) -> bytes:
    """The first ``limit`` bytes of ``views``, joined."""
    out, left = [], limit
    for v in views:
        if left <= 0:
            break
        part = v[:left]
        out.append(part)
        left -= len(part)
    return b"".join(out)


def make_identity() -> tuple[bytes, bytes]:
    """A new ephemeral self-signed certificate and its key (PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "erdma rank")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30)).sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


_made = threading.Lock()


@functools.cache
def _made_once() -> tuple[bytes, bytes]:
    return make_identity()


def _identity() -> tuple[bytes, bytes]:
    """This process's identity, made once: threads that secure connections at the same time (ranks of a test
    in one process) must not each make one and present another than the one they bind the session to."""
    with _made:
        return _made_once()


def make_contexts(identity: tuple[bytes, bytes]) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts presenting ``identity``."""
    cert, key = identity
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="erdma-tls-") as d:  # ssl loads keys from files only
        path = os.path.join(d, "rank.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(cert + key)
        server.load_cert_chain(path)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE  # the certificate is bound to the job's secret below, not to a CA
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return server, client


@functools.cache
def _contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    return make_contexts(_identity())


def secure(sock: socket.socket, *, server: bool, key: bytes, transcript: bytes, timeout: float,
           rank: int, peer: int) -> TlsSocket:
    """TLS over ``sock`` (after ``auth`` proved the peer), bound to it; raises AuthenticationError when a
    party in the middle holds either end of the TLS session."""
    server_ctx, client_ctx = _contexts()
    sock.settimeout(timeout)
    try:
        tls = (server_ctx.wrap_socket(sock, server_side=True) if server
               else client_ctx.wrap_socket(sock, server_hostname=None))
    except (ssl.SSLError, OSError) as exc:
        raise AuthenticationError(f"rank {rank}: TLS handshake with rank {peer} failed: {exc} "
                                  "(transport.tcp.tls must be the same on every rank)") from None
    accepting_cert = _own_der() if server else (tls.getpeercert(binary_form=True) or b"")
    bound = transcript + hashlib.sha256(accepting_cert).digest()
    mine, theirs = (_ACCEPT, _DIAL) if server else (_DIAL, _ACCEPT)
    tls.sendall(auth.prove(key, mine, bound))
    if not auth.check(key, theirs, bound, recv_exact(tls, auth.MAC)):  # type: ignore[arg-type]
        tls.close()
        raise AuthenticationError(f"rank {rank}: the TLS session with rank {peer} is not the one rank {peer} "
                                  "holds: something in the middle ended it (or the secrets differ)")
    return TlsSocket(tls)


@functools.cache
def _own_der() -> bytes:
    return ssl.PEM_cert_to_DER_cert(_identity()[0].decode())


class TlsSocket:
    """An ``ssl.SSLSocket`` with the calls ``progress`` makes on a plain non-blocking socket: ``sendmsg``
    (the views joined: TLS copies while it encrypts anyway) and ``recv_into`` report 'try again' as
    BlockingIOError; a TLS write that could not finish is retried with the same bytes."""

    family = socket.AF_INET

    def __init__(self, tls: ssl.SSLSocket) -> None:
        self.tls = tls
        self._pending: bytes | None = None  # a write TLS asked to retry: the same bytes must go again

    def fileno(self) -> int:
        return self.tls.fileno()

    def setblocking(self, flag: bool) -> None:
        self.tls.setblocking(flag)

    def settimeout(self, value: float | None) -> None:
        self.tls.settimeout(value)

    def setsockopt(self, *args: int) -> None:
        self.tls.setsockopt(*args)

    def getsockopt(self, *args: int) -> int | bytes:
        return self.tls.getsockopt(*args)

    def sendmsg(self, views: Sequence[memoryview | bytes]) -> int:
        data = self._pending if self._pending is not None else _head(views, _WRITE)
        try:
            n = self.tls.send(data)
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            self._pending = data
            raise BlockingIOError from None
        self._pending = None
        return n

    def recv_into(self, buf: memoryview) -> int:
        """As many bytes as ``buf`` takes, record after record (TLS gives one record, 16 KiB, per read: one
        poll round each would cost more than decrypting it)."""
        got, size = 0, len(buf)
        while got < size:
            try:
                k = self.tls.recv_into(buf[got:])
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                if got:
                    return got
                raise BlockingIOError from None
            except ssl.SSLZeroReturnError:
                return got
            if k == 0:
                return got
            got += k
        return got

    def shutdown(self, how: int) -> None:
        self.tls.shutdown(how)

    def close(self) -> None:
        self.tls.close()
