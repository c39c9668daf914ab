"""Signed, versioned, expiring records: what the ``dht`` discovery stores in the DHT (sans-IO, no network).

A job's records live under keys derived from its secret and name (``namespace``, ``dht_key``), so DHT nodes
and other jobs see neither. A record is ``MAGIC | version u64 | expires f64 | flags u8 | value | HMAC-SHA256``;
the MAC covers the DHT key too, so a record cannot be replayed under another key. A reader keeps only records
that verify and have not expired, and takes the highest version (a DHT node may still hold an older copy).
``flags`` bit 0 marks a deletion (a tombstone: the key reads as absent). DHT nodes, which hold no job's key,
check only the shape (``shape_ok``) before they store anything.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from typing import NamedTuple

MAGIC = b"eRD1"
_HEAD = struct.Struct("!4sQdB")
_MAC = 32
MAX_RECORD = 64 << 10  # bytes of a whole record (values are addresses and small job entries)
DELETED = 1


class Record(NamedTuple):
    version: int
    expires: float
    deleted: bool
    value: bytes


def namespace(secret: bytes, job: str) -> bytes:
    """The key a job's records are signed with and addressed by."""
    return hmac.new(secret, b"erdma dht job " + job.encode(), hashlib.sha256).digest()


def dht_key(ns: bytes, key: str) -> bytes:
    """The 160-bit DHT key of the job's ``key``."""
    return hmac.new(ns, b"key " + key.encode(), hashlib.sha256).digest()[:20]


def seal(ns: bytes, dkey: bytes, value: bytes, version: int, expires: float, deleted: bool = False) -> bytes:
    body = _HEAD.pack(MAGIC, version, expires, DELETED if deleted else 0) + value
    if len(body) + _MAC > MAX_RECORD:
        raise ValueError(f"a DHT record holds at most {MAX_RECORD - _MAC - _HEAD.size} bytes of value; got {len(value)}")
    return body + hmac.new(ns, dkey + body, hashlib.sha256).digest()


def shape_ok(blob: object) -> bool:
    """Whether ``blob`` is shaped like a record (what a DHT node checks before storing it)."""
    if not isinstance(blob, bytes) or not _HEAD.size + _MAC <= len(blob) <= MAX_RECORD:
        return False
    magic, _, expires, _ = _HEAD.unpack_from(blob)
    return magic == MAGIC and math.isfinite(expires)


def unseal(ns: bytes, dkey: bytes, blob: object, now: float) -> Record | None:
    """The record in ``blob`` if it is this job's, for this key, and not expired; else None."""
    if not shape_ok(blob):
        return None
    assert isinstance(blob, bytes)
    body, mac = blob[:-_MAC], blob[-_MAC:]
    if not hmac.compare_digest(hmac.new(ns, dkey + body, hashlib.sha256).digest(), mac):
        return None
    _, version, expires, flags = _HEAD.unpack_from(body)
    if expires <= now:
        return None
    return Record(version, expires, bool(flags & DELETED), body[_HEAD.size:])


def latest(ns: bytes, dkey: bytes, blobs: list[object], now: float) -> Record | None:
    """The highest version among the valid records in ``blobs``, or None."""
    valid = [r for r in (unseal(ns, dkey, b, now) for b in blobs) if r is not None]
    return max(valid, key=lambda r: r.version, default=None)
