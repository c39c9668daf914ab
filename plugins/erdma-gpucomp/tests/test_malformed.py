"""A payload that does not match what its metadata and the receiver's message size say is refused with
ValueError (the core turns it into a ProtocolError that fails the collective on every rank), before any
allocation larger than the receiver's own message."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import zstandard
from conftest import make


def decode(name: str, payload: bytes, meta: bytes, n: int = 100, dtype=np.float32) -> None:
    make(name, sending=False).decode(memoryview(payload), meta, np.dtype(dtype).name, np.empty(n, dtype))


def pieces(*sizes: int, fmt: int = 2, width: int = 4, piece: int = 1 << 16) -> bytes:
    """lz4/zstd metadata: format, shuffle width, piece bytes, piece count, each piece's size."""
    return struct.pack(f"<BBII{len(sizes)}I", fmt, width, piece, len(sizes), *sizes)


BIG = zstandard.ZstdCompressor().compress(b"\0" * (1 << 30))
SMALL = zstandard.ZstdCompressor().compress(b"\0" * 100)


@pytest.mark.parametrize("name, payload, meta, message", [
    ("fp16", b"\0" * 10, b"", "payload of 10 bytes, expected 200"),
    ("bf16", b"\0" * 400, b"", "payload of 400 bytes, expected 200"),
    ("int8", b"\0" * 10, struct.pack("<BI", 8, 64), "payload of 10 bytes, expected 136"),
    ("int8", b"\0" * 10, struct.pack("<BI", 3, 64), "names 3 bits in blocks of 64"),
    ("int8", b"\0" * 10, struct.pack("<BI", 8, 0), "names 8 bits in blocks of 0"),
    ("int4", b"\0" * 10, struct.pack("<BI", 4, 7), "names 4 bits in blocks of 7"),
    ("topk", b"\0" * 16, struct.pack("<I", 101), "names 101 elements of 100"),
    ("topk", struct.pack("<II", 100, 0), struct.pack("<I", 1), "index 100 is outside the 100 elements"),
    ("lz4", b"\xff" * 50, pieces(50), "lz4:"),
    ("lz4", b"\0" * 50, pieces(50, fmt=1), "names format 1"),
    ("lz4", b"\0" * 50, pieces(50, piece=0), "pieces of 0 bytes"),
    ("lz4", b"\0" * 50, pieces(50, piece=100), "lists 1 pieces of 100 bytes in 14 bytes, for a message of 400"),
    ("lz4", b"\0" * 50, pieces(50, 0)[:-4], "lists 2 pieces of 65536 bytes in 14 bytes"),
    ("lz4", b"\0" * 50, pieces(49), "the pieces' sizes add up to 49 bytes, the payload has 50"),
    ("zstd", BIG, pieces(len(BIG)), "zstd frame says 1073741824 bytes, expected 400"),
    ("zstd", SMALL, pieces(len(SMALL)), "zstd frame says 100 bytes, expected 400"),
    ("zstd", b"garbage", pieces(7), "zstd:"),
])
def test_malformed_payloads_are_refused(name, payload, meta, message):
    with pytest.raises((ValueError, struct.error), match=message):
        decode(name, payload, meta)


def test_short_metadata_is_refused():
    with pytest.raises(struct.error):
        decode("int8", b"", b"\x08")


def test_lz4_that_decodes_short_is_refused():
    import lz4.block

    short = lz4.block.compress(b"\1" * 200, store_size=False)
    with pytest.raises(ValueError, match="lz4: 200 bytes decoded, expected 400"):
        decode("lz4", short, pieces(len(short)))
