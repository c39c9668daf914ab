"""Signed, encrypted, versioned, expiring records: what the ``dht`` discovery stores in the DHT (sans-IO, no
network). The design is BEP 44's mutable items: a record's DHT key is the hash of a public key and a salt,
so a DHT node that holds no secret can still check that a record was signed by the key its address names,
and keeps only the newest valid one.

Every rank of a job derives the same ``JobKeys`` from the job's secret and name: an Ed25519 key pair that
signs its records, an AES-GCM key that encrypts their values, and the salt of each of the job's keys
(``erdma/job``, ``quic/addr/3``: HMACs, so neither DHT nodes nor other jobs learn the names). A record is::

    magic      4s  MAGIC
    version    Q   higher wins (a writer's clock in ns, or one more than its last)
    expires    d   Unix time after which nobody uses it
    flags      B   DELETED (a tombstone: the key reads as absent)
    public    32s  the job's Ed25519 public key
    salt      20s  which of the job's keys
    nonce     12s  AES-GCM's
    sealed         the value encrypted, with GCM's 16-byte tag (associated data: everything before it)
    signature 64s  Ed25519 over everything before it

and its DHT key is ``SHA-256("erdma dht" | public | salt)[:20]``. A DHT node stores a record only under
that key and with a valid signature (``check``): a record without the job's key cannot be stored at all,
so nobody overwrites the job's records, and of two valid ones it keeps the higher version, so an old one
sent again does not replace a new one. A reader keeps records that open (``unseal``: signature, then
decryption) and have not expired, and takes the highest version.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
from typing import NamedTuple

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

MAGIC = b"eRD2"
_HEAD = struct.Struct("!4sQdB32s20s12s")
_SIGNATURE = 64
_GCM_TAG = 16
# bytes of a whole record (values are addresses and small job entries): what one store RPC carries, as rpcudp
# packs it (at most 8,192 bytes of msgpack: the call's name, the node's id, the key and the record)
MAX_RECORD = 8192 - 128
MAX_VALUE = MAX_RECORD - _SIGNATURE - _HEAD.size - _GCM_TAG  # bytes of value one record holds
DELETED = 1


class Record(NamedTuple):
    version: int
    expires: float
    deleted: bool
    value: bytes


class JobKeys:
    """What a job's ranks derive from its secret and name (every rank the same)."""

    def __init__(self, secret: bytes, job: str) -> None:
        ns = hmac.new(secret, b"erdma dht job " + job.encode(), hashlib.sha256).digest()
        self._ns = ns
        self._signer = Ed25519PrivateKey.from_private_bytes(_derive(ns, b"sign"))
        self.public = self._signer.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self._aead = AESGCM(_derive(ns, b"seal"))

    def salt(self, key: str) -> bytes:
        return hmac.new(self._ns, b"key " + key.encode(), hashlib.sha256).digest()[:20]

    def dht_key(self, key: str) -> bytes:
        """The 160-bit DHT key of the job's ``key``."""
        return address(self.public, self.salt(key))

    def seal(self, key: str, value: bytes, version: int, expires: float, deleted: bool = False) -> bytes:
        head = _HEAD.pack(MAGIC, version, expires, DELETED if deleted else 0, self.public, self.salt(key),
                          os.urandom(12))
        body = head + self._aead.encrypt(head[-12:], value, head)
        if len(body) + _SIGNATURE > MAX_RECORD:
            raise ValueError(f"a DHT record holds at most {MAX_VALUE} bytes "
                             f"of value; got {len(value)}")
        return body + self._signer.sign(body)

    def unseal(self, key: str, blob: object, now: float) -> Record | None:
        """The record in ``blob`` if it is this job's, for ``key``, and not expired; else None."""
        head = check(self.dht_key(key), blob)
        if head is None or head.public != self.public or head.expires <= now:
            return None
        assert isinstance(blob, bytes)
        try:
            value = self._aead.decrypt(head.nonce, blob[_HEAD.size:-_SIGNATURE], blob[:_HEAD.size])
        except InvalidTag:
            return None
        return Record(head.version, head.expires, head.deleted, value)

    def latest(self, key: str, blobs: list[object], now: float) -> Record | None:
        """The highest version among the records in ``blobs`` that open, or None."""
        valid = [r for r in (self.unseal(key, b, now) for b in blobs) if r is not None]
        return max(valid, key=lambda r: r.version, default=None)


def _derive(ns: bytes, purpose: bytes) -> bytes:
    return hmac.new(ns, b"erdma dht " + purpose, hashlib.sha256).digest()


def address(public: bytes, salt: bytes) -> bytes:
    """The DHT key of the record a public key signs under a salt."""
    return hashlib.sha256(b"erdma dht" + public + salt).digest()[:20]


class Head(NamedTuple):
    version: int
    expires: float
    deleted: bool
    public: bytes
    nonce: bytes


def shape_ok(blob: object) -> bool:
    """Whether ``blob`` is shaped like a record (the cheap check before ``check``)."""
    if not isinstance(blob, bytes) or not _HEAD.size + _GCM_TAG + _SIGNATURE <= len(blob) <= MAX_RECORD:
        return False
    magic, _, expires, *_ = _HEAD.unpack_from(blob)
    return magic == MAGIC and math.isfinite(expires)


def check(dkey: bytes, blob: object) -> Head | None:
    """What a DHT node checks before it stores ``blob`` under ``dkey``, holding no job's secret: the shape,
    that ``dkey`` is the address of the record's public key and salt, and the signature. The record's head,
    or None."""
    if not shape_ok(blob):
        return None
    assert isinstance(blob, bytes)
    _, version, expires, flags, public, salt, nonce = _HEAD.unpack_from(blob)
    if address(public, salt) != dkey:
        return None
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(blob[-_SIGNATURE:], blob[:-_SIGNATURE])
    except InvalidSignature:
        return None
    return Head(version, expires, bool(flags & DELETED), public, nonce)
