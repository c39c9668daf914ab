"""Proving membership of the job, sans-IO: a mutual challenge-response on the job's secret
(``security.secret``) that every connection a rank accepts must pass, the store's and the transports'.

Each side sends a fresh random nonce and answers the other's with ``HMAC-SHA256(key, label || transcript)``,
where the transcript holds both nonces and everything the connection is about (job, both ranks, world
size). Nothing an outsider can read (the store, the wire, an earlier handshake) lets it answer a new
challenge; a recorded answer is useless against a fresh nonce, and the two directions use different labels,
so one side's answer cannot be reflected back as the other's. Without a secret the same exchange runs with
an empty key: it then proves nothing, which ``warn_if_exposed`` says loudly.

These classes consume and produce bytes only; the callers own the sockets and the clocks.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import struct
import warnings
from collections.abc import Callable

from ..errors import AuthenticationError, ConfigError, ProtocolError
from ..wire import HELLO_MAGIC, WIRE_VERSION, unpack_hello

log = logging.getLogger("erdma.security")
NONCE = 16
MAC = 32

# ---- keys and proofs ---------------------------------------------------------------------------------------


def derive(secret: bytes, purpose: bytes) -> bytes:
    """A key for one purpose (the store, one job's transport) from the job's secret."""
    return hmac.new(secret, b"erdma key:" + purpose, hashlib.sha256).digest()


def job_key(secret: bytes, job: int) -> bytes:
    return derive(secret, b"job:" + job.to_bytes(8, "little"))


def store_key(secret: bytes) -> bytes:
    return derive(secret, b"store")


def prove(key: bytes, label: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, label + b"|" + transcript, hashlib.sha256).digest()


def nonce() -> bytes:
    return os.urandom(NONCE)


def check(key: bytes, label: bytes, transcript: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(prove(key, label, transcript), mac)


# ---- the transport handshake (HELLO, wire version 5) --------------------------------------------------------

HELLO = struct.Struct("<4sHHQIIHH16s")  # magic, version, status, job, rank, world, lane, lanes, nonce
MAX_LANES = 64  # connections one pair of ranks may open (``transport.tcp.connections``)
# statuses: what the dialler asks, what the acceptor answers
REQUEST, CHALLENGE, ACCEPTED = 0, 1, 2
WRONG_JOB, WRONG_WORLD, UNEXPECTED_RANK, DUPLICATE_RANK, BAD_PROOF, WRONG_LANES = 10, 11, 12, 13, 14, 15
REASONS = {
    WRONG_JOB: "it belongs to another job",
    WRONG_WORLD: "its world size differs",
    UNEXPECTED_RANK: "that rank does not connect to this one",
    DUPLICATE_RANK: "another process already connected as that rank (duplicate rank)",
    BAD_PROOF: "it could not prove the job's secret (a different security.secret?)",
    WRONG_LANES: "it opens another number of connections per pair of ranks (transport.tcp.connections differs)",
}
_DIAL, _ACCEPT = b"erdma-hello-dial", b"erdma-hello-accept"


def pack_hello(status: int, job: int, rank: int, world: int, nonce_: bytes = bytes(NONCE), lane: int = 0,
               lanes: int = 1) -> bytes:
    return HELLO.pack(HELLO_MAGIC, WIRE_VERSION, status, job, rank, world, lane, lanes, nonce_)


def parse_hello(data: bytes) -> tuple[int, int, int, int, bytes]:
    """``(status, job, rank, world, nonce)`` of a HELLO; ProtocolError for anything else."""
    status, job, rank, world, _, _, nonce_ = unpack_hello(HELLO, data)
    return status, job, rank, world, nonce_


def parse_lanes(data: bytes) -> tuple[int, int]:
    """``(lane, lanes)`` of a HELLO: which of the pair's connections it opens, and how many the pair has."""
    return tuple(unpack_hello(HELLO, data)[4:6])  # type: ignore[return-value]


def _transcript(job: int, dialler: int, acceptor: int, world: int, lane: int, lanes: int, n_dial: bytes,
                n_accept: bytes) -> bytes:
    return struct.pack("<QIIIHH", job, dialler, acceptor, world, lane, lanes) + n_dial + n_accept


class Dialling:
    """The dialling side: ``first()`` is its HELLO; ``on_challenge(reply)`` checks the acceptor's answer
    (``HELLO.size + MAC`` bytes) and returns this side's proof, to send even when the acceptor's was wrong
    (so that it learns the secrets differ) before ``error`` is raised; ``on_verdict(hello)`` ends it.
    ``lane`` of ``lanes``: which of the pair's connections this one is (a pool, ``transport.tcp.connections``)."""

    def __init__(self, key: bytes, job: int, rank: int, peer: int, world: int, nonce_: bytes | None = None,
                 lane: int = 0, lanes: int = 1) -> None:
        if not 0 <= lane < lanes <= MAX_LANES:
            raise ValueError(f"lane {lane} of {lanes}: at most {MAX_LANES} connections per pair")
        self.key, self.job, self.rank, self.peer, self.world = key, job, rank, peer, world
        self.lane, self.lanes = lane, lanes
        self.nonce = nonce_ or nonce()
        self.error: AuthenticationError | None = None
        self.transcript = b""  # what both proofs covered (TLS binds its session to it)

    def first(self) -> bytes:
        return pack_hello(REQUEST, self.job, self.rank, self.world, self.nonce, self.lane, self.lanes)

    def on_challenge(self, data: bytes) -> bytes | None:
        """The proof to send, or None when the acceptor refused (``error`` says why)."""
        status, _, rank, _, theirs = parse_hello(data[:HELLO.size])
        if status != CHALLENGE:
            self.error = AuthenticationError(self._refused(status))
            return None
        if rank != self.peer:
            raise ProtocolError(f"rank {self.rank}: the process at rank {self.peer}'s address says it is rank {rank}")
        t = self.transcript = _transcript(self.job, self.rank, self.peer, self.world, self.lane, self.lanes,
                                          self.nonce, theirs)
        if not check(self.key, _ACCEPT, t, data[HELLO.size:HELLO.size + MAC]):
            self.error = AuthenticationError(f"rank {self.rank}: the process at rank {self.peer}'s address could not "
                                             "prove it knows the job's secret (security.secret differs between "
                                             "ranks, or it is not a rank of this job)")
        return prove(self.key, _DIAL, t)

    def on_verdict(self, data: bytes) -> None:
        status = parse_hello(data)[0]
        if self.error is not None:
            raise self.error
        if status != ACCEPTED:
            raise AuthenticationError(self._refused(status))

    def _refused(self, status: int) -> str:
        return (f"rank {self.rank}: rank {self.peer} refused the connection: "
                f"{REASONS.get(status, f'status {status}')}")


class Accepting:
    """The accepting side of one connection. Feed it exactly ``need`` bytes at a time (``feed`` returns
    what to send back); when ``need`` is 0 it has ended: ``rank_proven`` is the peer that proved the
    secret, or None with ``refused`` the reason. ``dialers``: the ranks that may dial this one.
    ``claim(rank, lane, lanes)`` is asked once a peer has proved the secret (``lane`` of the pair's
    ``lanes`` connections): None takes the connection, ``DUPLICATE_RANK`` refuses it (another connection
    proved that rank and lane first; ``duplicate`` then records that a rank of this job was claimed twice
    by holders of the secret), ``WRONG_LANES`` refuses a pool of another size."""

    def __init__(self, key: bytes, job: int, rank: int, world: int, dialers: range,
                 claim: Callable[[int, int, int], int | None], nonce_: bytes | None = None) -> None:
        self.key, self.job, self.rank, self.world = key, job, rank, world
        self.dialers, self.claim = dialers, claim
        self.duplicate = False
        self.nonce = nonce_ or nonce()
        self.need = HELLO.size
        self.rank_claimed = -1
        self.lane, self.lanes = 0, 1  # which of the pair's connections this is (as the dialler says)
        self.rank_proven: int | None = None
        self.refused = ""
        self._t = b""

    def feed(self, data: bytes) -> bytes:
        if self._t:  # the dialler's proof
            self.need = 0
            if not check(self.key, _DIAL, self._t, data):
                return self._refuse(BAD_PROOF)
            status = self.claim(self.rank_claimed, self.lane, self.lanes)
            if status is not None:  # another connection proved that rank first
                self.duplicate = status == DUPLICATE_RANK
                return self._refuse(status)
            self.rank_proven = self.rank_claimed
            return pack_hello(ACCEPTED, self.job, self.rank, self.world)
        status, job, rank, world, theirs = parse_hello(data)
        self.rank_claimed = rank
        if status != REQUEST:
            raise ProtocolError(f"hello with status {status} where a request was due")
        self.lane, self.lanes = parse_lanes(data)
        if not 0 <= self.lane < self.lanes <= MAX_LANES:
            raise ProtocolError(f"hello for connection {self.lane} of {self.lanes} (at most {MAX_LANES})")
        refusal = (WRONG_JOB if job != self.job else WRONG_WORLD if world != self.world
                   else UNEXPECTED_RANK if rank not in self.dialers else None)
        if refusal is not None:
            self.need = 0
            return self._refuse(refusal)
        self._t = _transcript(self.job, rank, self.rank, self.world, self.lane, self.lanes, theirs, self.nonce)
        self.need = MAC
        return (pack_hello(CHALLENGE, self.job, self.rank, self.world, self.nonce, self.lane, self.lanes)
                + prove(self.key, _ACCEPT, self._t))

    @property
    def transcript(self) -> bytes:
        """What both proofs covered (TLS binds its session to it)."""
        return self._t

    def _refuse(self, status: int) -> bytes:
        self.refused = f"claimed rank {self.rank_claimed}: {REASONS[status]}"
        return pack_hello(status, self.job, self.rank, self.world)


# ---- the store handshake -----------------------------------------------------------------------------------

STORE_HELLO = struct.Struct("<4sH16s")
STORE_MAGIC = b"ERDS"
STORE_VERSION = 1
_CLIENT, _SERVER = b"erdma-store-client", b"erdma-store-server"


class StoreClient:
    """``first()``; then ``on_challenge(nonce_s + mac_s)`` returns the client's proof or raises
    AuthenticationError when the server cannot prove the secret."""

    def __init__(self, key: bytes, where: str) -> None:
        self.key, self.where, self.nonce = key, where, nonce()

    def first(self) -> bytes:
        return STORE_HELLO.pack(STORE_MAGIC, STORE_VERSION, self.nonce)

    def on_challenge(self, data: bytes) -> bytes:
        theirs, mac = data[:NONCE], data[NONCE:NONCE + MAC]
        t = self.nonce + theirs
        if not check(self.key, _SERVER, t, mac):
            raise AuthenticationError(f"the store at {self.where} could not prove it knows the job's secret "
                                      "(security.secret differs from rank 0's, or another program owns that port)")
        return prove(self.key, _CLIENT, t)


class StoreServer:
    """``on_hello(STORE_HELLO bytes)`` returns the challenge (``NONCE + MAC`` bytes); ``on_proof(mac)``
    says whether the client proved the secret. As a ``gate.Handshake``: feed it ``need`` bytes at a time;
    once ``need`` is 0, ``proven`` says whether the client proved it (the last reply is the verdict byte)."""

    def __init__(self, key: bytes) -> None:
        self.key, self.nonce, self._t = key, nonce(), b""
        self.need = STORE_HELLO.size
        self.proven = False

    def on_hello(self, data: bytes) -> bytes:
        magic, version, theirs = STORE_HELLO.unpack(data)
        if magic != STORE_MAGIC:
            raise ProtocolError(f"bad store hello magic {magic!r}; not an eRDMA rank")
        if version != STORE_VERSION:
            raise ProtocolError(f"store client speaks version {version}, this store {STORE_VERSION}")
        self._t = theirs + self.nonce
        return self.nonce + prove(self.key, _SERVER, self._t)

    def on_proof(self, mac: bytes) -> bool:
        return bool(self._t) and check(self.key, _CLIENT, self._t, mac)

    def feed(self, data: bytes) -> bytes:
        if not self._t:
            challenge = self.on_hello(data)
            self.need = MAC
            return challenge
        self.proven = self.on_proof(data)
        self.need = 0
        return b"\0" if self.proven else b"\1"


# ---- no secret on an exposed address --------------------------------------------------------------------------


def require(secret: bytes, required: bool) -> None:
    """``security.require_secret``: refuse to start without a secret."""
    if required and not secret:
        raise ConfigError("config key 'security.secret': empty, and security.require_secret is true; set "
                          "ERDMA_SECRET (the same value on every rank; `erdma run` makes one per job)")


def warn_if_exposed(host: str, secret: bytes, what: str) -> None:
    """Say loudly when ``what`` listens on ``host``, an address other hosts can reach, and the job has no
    secret: anyone who reaches it can then join."""
    if secret or _loopback(host):
        return
    msg = (f"{what} listens on {host or 'every interface'} and the job has no secret (security.secret / "
           "ERDMA_SECRET): anyone who can reach that address can join the job, read and change its data. "
           "Set the same ERDMA_SECRET on every rank (`erdma run` makes one per job); "
           "security.require_secret = true makes this an error.")
    log.warning("%s", msg)
    warnings.warn(msg, stacklevel=3)


def _loopback(host: str) -> bool:
    if host in ("localhost",) or host.startswith("local:"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
