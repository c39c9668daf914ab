"""Compression on the collective path: which compressor encodes what this rank sends, whether a message goes
raw or encoded (``Codecs.sends_raw`` then ``Codecs.encode``: the one place that decides it), which decodes
what arrives (by the codec id in its frame), and, for a lossy compressor, the bookkeeping that keeps every
rank's result bit-identical (``Forwarding``). A run (``compressed_run``) asks these per message; no hook is
called here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..compression import Compressor, Site
from ..errors import ConfigError, ProtocolError
from ..protocol.limits import encoded_limit
from ..wire import RAW, Header, codec_id

log = logging.getLogger("erdma.compression")

Outgoing = tuple[int, int, memoryview]  # (codec id, metadata bytes, payload)
MIXED = object()  # Forwarding.lookup: the range is partly a peer's
OWN = object()  # Forwarding.lookup: the range is this rank's own


PROBE_EVERY = 32  # compression.policy auto: every so many messages are encoded anyway, to keep measuring


def _average(old: float | None, new: float) -> float:
    return new if old is None else 0.8 * old + 0.2 * new


REDUCTIONS = frozenset({"allreduce", "reduce", "reduce_scatter"})


def parse_ops(value: str, lossy: bool) -> frozenset[str] | None:
    """``compression.ops`` as the set of collectives to compress (None: every one)."""
    from ..protocol.ops import COLLECTIVES

    text = value.strip()
    if text == "all" or (text == "auto" and not lossy):
        return None
    if text == "auto":
        return REDUCTIONS
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in COLLECTIVES]
    if bad or not names:
        raise ConfigError(f"config key 'compression.ops': invalid value {value!r}"
                          f"{f' ({bad[0]!r} is not a collective)' if bad else ''}; valid: auto, all, or a "
                          f"comma-separated list of {', '.join(COLLECTIVES)}")
    return frozenset(names)


def applies(codecs: Codecs) -> str:
    """What compression does in this job, in words: which compressor, on which collectives, from what size."""
    if codecs.sender is None:
        return "no compression"
    which = "every collective" if codecs.ops is None else ", ".join(sorted(codecs.ops))
    how = "per message when it saves time on the link" if codecs.link_rate is not None else "every message"
    return (f"compression {codecs.sender.name!r} ({'lossy' if codecs.lossy else 'lossless'}) on {which}: "
            f"{how} of {codecs.min_bytes} bytes or more, smaller ones raw")


QUIET_AFTER = 20  # collectives with a compressor configured and nothing encoded before ``Codecs.issued`` warns


class Codecs:
    """This rank's compressors: the configured one for sending (None: everything goes raw) and, for
    receiving, any installed one, found by the codec id a frame carries."""

    def __init__(self, sender: Compressor | None, min_bytes: int, lookup: Any,
                 ops: frozenset[str] | None = None, link_rate: Callable[[int], float | None] | None = None,
                 pipeline: bool = False, rank: int = 0) -> None:
        """``lookup(codec_id) -> Compressor | None`` makes the receiving side's instance of a codec; ``ops``:
        the collectives whose messages ``sender`` encodes (None: all); ``link_rate(peer)``: bytes per second
        the transport measured towards a global rank (given: ``compression.policy = "auto"``, see ``worth``);
        ``pipeline``: a step's next message is encoded on a helper thread while the current one is sent
        (``ahead``); ``rank``: this rank (log lines name it)."""
        self.sender = sender
        self.rank = rank
        self.pipeline = pipeline and sender is not None
        self._helper: ThreadPoolExecutor | None = None
        self._helper_lock = threading.Lock()
        self.link_rate = link_rate
        self.encode_s: float | None = None  # seconds per raw byte to encode (moving average of this rank's)
        self.decode_s: float | None = None  # ... to decode a message of this codec (this rank's receives)
        self.ratio: float | None = None  # bytes sent per raw byte
        self._asked = 0
        self._rates: dict[int, float | None] = {}  # link_rate per peer, as last read
        self.sender_id = codec_id(sender.name) if sender is not None else RAW
        self.lossy = bool(sender is not None and sender.lossy)
        self.min_bytes = min_bytes
        self.ops = ops
        self._lookup = lookup
        self._decoders: dict[int, Compressor] = {self.sender_id: sender} if sender is not None else {}
        self._receiving: Codecs | None = None
        # what the sending compressor did with the messages offered to it (``counted``, ``stats``)
        self._stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self._issued = 0  # collectives issued with this sender configured (``issued``)

    def counted(self, what: str, raw_bytes: int, wire_bytes: int = 0) -> None:
        """Count one message: ``encoded`` (``wire_bytes`` went out for ``raw_bytes``), or sent raw because it was
        ``small`` (under ``min_bytes``), ``skipped`` by ``compression.policy = "auto"`` or ``declined`` by the
        codec (a dtype it does not take, or no smaller)."""
        with self._stats_lock:
            first = what == "encoded" and not self._stats["encoded.messages"]
            self._stats[f"{what}.messages"] += 1
            self._stats[f"{what}.raw_bytes"] += raw_bytes
            if what == "encoded":
                self._stats["encoded.wire_bytes"] += wire_bytes
        if first and self.sender is not None:
            log.info("rank %d: compression %r applies: a message of %d bytes went out as %d", self.rank,
                     self.sender.name, raw_bytes, wire_bytes)

    def issued(self, op: str) -> None:
        """One more collective was issued (on the caller's thread). After the first ``QUIET_AFTER`` with
        nothing encoded, one WARNING says why: a configured compressor that never applies is a setting that
        silently does nothing (a small model's messages under ``compression.min_bytes``, say)."""
        if self.sender is None:
            return
        with self._stats_lock:
            self._issued += 1
            if self.ops is not None and op not in self.ops:
                self._stats["uncovered.collectives"] += 1
            if self._issued != QUIET_AFTER or self._stats["encoded.messages"]:
                return
            got = dict(self._stats)
        why = ", ".join(f"{got.get(f'{what}.messages', 0)} messages {how}" for what, how in (
            ("small", f"under compression.min_bytes ({self.min_bytes} bytes)"),
            ("skipped", "skipped by compression.policy"), ("declined", "declined by the codec")))
        ops = "all" if self.ops is None else ",".join(sorted(self.ops))
        log.warning("rank %d: compression %r has encoded nothing in the first %d collectives: %s; %d collectives "
                    "not in compression.ops (%s). Lower compression.min_bytes or widen compression.ops for it to "
                    "apply.", self.rank, self.sender.name, QUIET_AFTER, why, got.get("uncovered.collectives", 0), ops)

    def stats(self) -> dict[str, int]:
        """The counts of ``counted``, as ``<what>.messages`` and ``<what>.raw_bytes`` (and
        ``encoded.wire_bytes``); empty when nothing is compressed."""
        with self._stats_lock:
            return dict(self._stats)

    def sends_raw(self, peer: int, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` for global rank ``peer`` goes raw without being offered to the codec:
        under ``min_bytes``, or not ``worth`` it on the link (``compression.policy = "auto"``); counted. The
        rest is offered to the codec (``encode``), which may still decline it. Together, the one place that
        decides how a message goes; what a run forwards as it came is the run's (``compressed_run``)."""
        if nbytes < self.min_bytes:
            self.counted("small", nbytes)
            return True
        if not self.worth(peer, nbytes):
            self.counted("skipped", nbytes)
            return True
        return False

    def worth(self, peer: int, nbytes: int) -> bool:
        """Whether to encode ``nbytes`` for global rank ``peer``: always, unless ``link_rate`` was given; then
        only when the bytes encoding saves would take longer on the link than encoding and decoding take (both
        measured here; until they are, and every ``PROBE_EVERY``-th message after, it encodes). The link rate is
        read once per peer and again with each probe, not per message."""
        if self.link_rate is None or self.encode_s is None or self.ratio is None:
            return True
        self._asked += 1
        if self._asked % PROBE_EVERY == 0:
            self._rates[peer] = self.link_rate(peer)  # read again with each probe (for TCP, a syscall)
            return True
        rate = self._rates[peer] if peer in self._rates else self._rates.setdefault(peer, self.link_rate(peer))
        if rate is None:
            return True
        decode_s = self.decode_s if self.decode_s is not None else self.encode_s
        return nbytes * (1 - self.ratio) / rate > nbytes * (self.encode_s + decode_s)

    def ahead(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on this rank's encoding thread (one for every group, made on first use): the
        executor encodes a step's next message there while it sends the current one. A compressor that
        computes on a GPU gives that thread its own CUDA stream."""
        helper = self._helper
        if helper is None:
            with self._helper_lock:
                if self._helper is None:
                    self._helper = ThreadPoolExecutor(1, thread_name_prefix="erdma-encode")
                helper = self._helper
        return helper.submit(fn, *args)

    def close(self) -> None:
        """Stop the encoding thread (after what it is running)."""
        with self._helper_lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True, cancel_futures=True)

    def for_op(self, op: str) -> Codecs:
        """These codecs for collective ``op``: themselves, or, for an op the compressor does not apply to, a
        twin that sends raw and still decodes whatever arrives."""
        if self.sender is None or self.ops is None or op in self.ops:
            return self
        if self._receiving is None:
            twin = Codecs(None, self.min_bytes, self._lookup)
            twin._decoders = self._decoders
            self._receiving = twin
        return self._receiving

    def encode(self, data: np.ndarray, dtype: str, site: Site | None) -> Outgoing | None:
        """``data`` encoded for the wire, or None to send it raw."""
        assert self.sender is not None
        start = time.perf_counter()
        enc = self.sender.encode(data, dtype, site)
        took = time.perf_counter() - start
        if enc is None:
            self.counted("declined", data.nbytes)
            return None  # the codec sends these raw (a dtype it does not handle, say): nothing measured
        body = memoryview(enc.payload).cast("B")
        meta = bytes(enc.meta)
        if data.nbytes:
            self.encode_s = _average(self.encode_s, took / data.nbytes)
            self.ratio = _average(self.ratio, min(1.0, (len(meta) + len(body)) / data.nbytes))
        if len(meta) + len(body) > encoded_limit(data.nbytes):
            self.counted("declined", data.nbytes)
            return None  # larger than the raw bytes allow: raw instead
        self.counted("encoded", data.nbytes, len(meta) + len(body))
        if not meta:
            return self.sender_id, 0, body
        joined = bytearray(len(meta) + len(body))
        joined[:len(meta)] = meta
        joined[len(meta):] = body
        return self.sender_id, len(meta), memoryview(joined)

    def decode_own(self, out: Outgoing, dtype: str, into: np.ndarray) -> None:
        """What this rank's peers will decode from ``out``, written over the elements it encoded."""
        assert self.sender is not None
        _, meta, payload = out
        self.sender.decode(payload[meta:], bytes(payload[:meta]), dtype, into)

    def decode(self, header: Header, payload: memoryview, dtype: str, out: np.ndarray, rank: int, peer: int) -> None:
        """Decode a message from ``peer`` into ``out`` (its element count and dtype storage)."""
        comp = self._decoders.get(header.codec)
        if comp is None:
            comp = self._lookup(header.codec)
            if comp is None:
                raise ProtocolError(f"rank {rank}: rank {peer} sent a payload encoded by codec {header.codec:#010x}, "
                                    "which no compressor installed here has (erdma plugins lists them)")
            self._decoders[header.codec] = comp
        start = time.perf_counter()
        try:
            comp.decode(payload[header.meta:], bytes(payload[:header.meta]), dtype, out)
        except Exception as exc:
            raise ProtocolError(f"rank {rank}: compressor {comp.name!r} could not decode rank {peer}'s "
                                f"{header.nbytes}-byte payload of {header.count} elements: {type(exc).__name__}: "
                                f"{exc}") from exc
        if header.codec == self.sender_id and out.nbytes:
            self.decode_s = _average(self.decode_s, (time.perf_counter() - start) / out.nbytes)


NO_CODECS = Codecs(None, 0, lambda cid: None)  # nothing to send with, nothing to decode with: every message raw


class Forwarding:
    """One collective's record, for a lossy compressor, of element ranges that hold exactly what a peer
    sent (or what this rank sent encoded): a send of exactly such a range forwards those bytes as they came;
    a send that covers only part of one goes raw (the exact decoded values); anything else is this rank's
    own and is encoded afresh. So every element any rank ends with came from one encoding."""

    def __init__(self) -> None:
        self._pieces: dict[str, list[tuple[int, int, Outgoing | None]]] = {}  # None: exact values, send raw

    def record(self, buf: str, lo: int, hi: int, piece: Outgoing | None) -> None:
        self.forget(buf, lo, hi)
        if hi > lo:
            self._pieces.setdefault(buf, []).append((lo, hi, piece))

    def forget(self, buf: str, lo: int, hi: int) -> None:
        """[lo, hi) is written over. A piece it cuts keeps its other part, as exact values (send raw)."""
        pieces = self._pieces.get(buf)
        if not pieces:
            return
        kept = []
        for plo, phi, piece in pieces:
            if phi <= lo or plo >= hi:
                kept.append((plo, phi, piece))
                continue
            if plo < lo:
                kept.append((plo, lo, None))
            if phi > hi:
                kept.append((hi, phi, None))
        self._pieces[buf] = kept

    def lookup(self, buf: str, lo: int, hi: int) -> Any:
        """The piece that is exactly [lo, hi) (an Outgoing, or None for exact values), ``MIXED`` when the
        range overlaps recorded pieces otherwise, and ``OWN`` when it overlaps none."""
        found: Any = OWN
        for plo, phi, piece in self._pieces.get(buf, ()):
            if plo == lo and phi == hi:
                return piece
            if plo < hi and lo < phi:
                found = MIXED
        return found

    def copied(self, src: str, src_lo: int, dst: str, dst_lo: int, n: int) -> None:
        """A local copy: the destination holds what the source held."""
        moved = [(plo, phi, piece) for plo, phi, piece in self._pieces.get(src, ())
                 if plo < src_lo + n and src_lo < phi]
        self.forget(dst, dst_lo, dst_lo + n)
        for plo, phi, piece in moved:
            lo, hi = max(plo, src_lo), min(phi, src_lo + n)
            whole = (lo, hi) == (plo, phi)
            self._pieces.setdefault(dst, []).append((lo - src_lo + dst_lo, hi - src_lo + dst_lo,
                                                     piece if whole else None))

