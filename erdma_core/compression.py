"""The compressor interface, and the built-in ``none`` compressor.

The executor hands every message of a collective whose raw size is at least ``compression.min_bytes`` to
the configured compressor's ``encode``; the frame carries the compressor's codec id (``wire.codec_id(name)``)
and the metadata it returned, so a receiver decodes with the compressor of that id, whatever its own config
selects. Reductions run on decoded values. A lossy compressor's sender keeps what its receivers will see
(its own copy of the sent elements becomes the decoded values) and a rank that passes on elements it
received forwards the encoded bytes as they came, so every rank ends with the same bits.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

import attrs
import numpy as np


@attrs.frozen
class Site:
    """Where one encode happens, the same from one call to the next: ``key`` identifies the caller's buffer
    (the ``key=`` a collective was given, else its memory: address, bytes and dtype), then the op, the
    algorithm, the step of the schedule and the element range. Error feedback keeps one residual per Site."""

    key: Hashable
    op: str
    algorithm: str
    step: int
    offset: int
    count: int


@attrs.frozen
class Encoded:
    """What ``encode`` returns: ``payload`` (any buffer-protocol object) and ``meta``, the bytes ``decode``
    needs besides it (scales, shapes, ...; at most 64 KiB)."""

    payload: Any
    meta: bytes = b""


class Compressor(Protocol):
    """``name``: the registered name (its wire id derives from it). ``lossy``: decode(encode(x)) may differ
    from x (then the engine keeps every rank's copy identical, as the module docstring says).

    ``encode(data, dtype, site)``: ``data`` is a contiguous 1-D numpy array holding elements of the eRDMA
    dtype ``dtype`` (bfloat16 as uint16 bits); ``site`` is None when the buffer has no stable identity
    (error feedback must then keep nothing). Return an ``Encoded``, or None to send these elements raw
    (a dtype the codec does not handle, incompressible data). Must not modify ``data``.

    ``encode`` may run on the executor's encoding thread (``compression.pipeline``) while ``decode`` runs on
    the collective's, and for several groups at once: shared state needs a lock. The encodes of one
    collective happen in message order.

    ``decode(payload, meta, dtype, out)``: write the decoded elements into ``out`` (a contiguous 1-D numpy
    array of ``dtype``'s storage and of the message's element count). Must depend on nothing but its
    arguments: the receiver's instance may be configured differently from the sender's.
    """

    name: str
    lossy: bool

    def encode(self, data: np.ndarray, dtype: str, site: Site | None) -> Encoded | None: ...

    def decode(self, payload: memoryview, meta: bytes, dtype: str, out: np.ndarray) -> None: ...


class NoCompression:
    """Payloads go as they are."""

    name = "none"
    lossy = False

    def __init__(self, config: Any = None, section: dict[str, Any] | None = None) -> None:
        pass

    def encode(self, data: np.ndarray, dtype: str, site: Site | None) -> Encoded | None:
        return None

    def decode(self, payload: memoryview, meta: bytes, dtype: str, out: np.ndarray) -> None:
        out.view(np.uint8)[:] = np.frombuffer(payload, np.uint8)
