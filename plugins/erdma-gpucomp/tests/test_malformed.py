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


@pytest.mark.parametrize("name, payload, meta, message", [
    ("fp16", b"\0" * 10, b"", "payload of 10 bytes, expected 200"),
    ("bf16", b"\0" * 400, b"", "payload of 400 bytes, expected 200"),
    ("int8", b"\0" * 10, struct.pack("<BI", 8, 64), "payload of 10 bytes, expected 136"),
    ("int8", b"\0" * 10, struct.pack("<BI", 3, 64), "names 3 bits in blocks of 64"),
    ("int8", b"\0" * 10, struct.pack("<BI", 8, 0), "names 8 bits in blocks of 0"),
    ("int4", b"\0" * 10, struct.pack("<BI", 4, 7), "names 4 bits in blocks of 7"),
    ("topk", b"\0" * 16, struct.pack("<I", 101), "names 101 elements of 100"),
    ("topk", struct.pack("<II", 100, 0), struct.pack("<I", 1), "index 100 is outside the 100 elements"),
    ("lz4", b"\xff" * 50, struct.pack("<BB", 1, 4), "lz4:"),
    ("lz4", b"\0" * 50, struct.pack("<BB", 2, 4), "names format 2"),
    ("zstd", zstandard.ZstdCompressor().compress(b"\0" * (1 << 30)), struct.pack("<BB", 1, 4),
     "zstd frame says 1073741824 bytes, expected 400"),
    ("zstd", zstandard.ZstdCompressor().compress(b"\0" * 100), struct.pack("<BB", 1, 4),
     "zstd frame says 100 bytes, expected 400"),
    ("zstd", b"garbage", struct.pack("<BB", 1, 4), "zstd:"),
])
def test_malformed_payloads_are_refused(name, payload, meta, message):
    with pytest.raises((ValueError, struct.error), match=message):
        decode(name, payload, meta)


def test_short_metadata_is_refused():
    with pytest.raises(struct.error):
        decode("int8", b"", b"\x08")


def test_lz4_that_decodes_short_is_refused():
    import lz4.block

    with pytest.raises(ValueError, match="lz4: 200 bytes decoded, expected 400"):
        decode("lz4", lz4.block.compress(b"\1" * 200, store_size=False), struct.pack("<BB", 1, 4))
