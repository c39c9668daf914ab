"""The lossless compressors.

``lz4`` and ``zstd`` run on the CPU (python-lz4, zstandard) or on a GPU (nvcomp, bare format), and both
write the same format: the message's bytes, byte-shuffled for multi-byte dtypes (all first bytes of the
elements, then all second bytes, ...: the exponents of floats end up side by side, which is what compresses),
cut into pieces of ``PIECE`` bytes, each one LZ4 block or one zstd frame; the metadata lists each piece's
encoded size. A GPU compresses the pieces in parallel (one bare LZ4 block of a whole 4 MiB message ran at
0.02 GB/s on an H200); a CPU decodes what a GPU encoded and the other way round.
``cascaded``, ``bitcomp``, ``ans`` and ``gdeflate`` exist only in nvcomp: only a rank with a GPU sends them,
and only a rank with a GPU can decode them.

Nothing is allocated on the sender's word: the decoded size must be the receiver's own message size, and
decompression is bounded by it.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from erdma_core.sdk import Encoded, Site

from . import device, nvcomp_gpu

_META = struct.Struct("<BBII")  # format (2), shuffle width in bytes (1: none), piece bytes, pieces; then u32 sizes
_FORMAT = 2
PIECE = 1 << 16  # bytes per independently compressed piece (nvcomp's default chunk)
MAX_PIECES = 8192  # a message of more than PIECE * MAX_PIECES bytes gets larger pieces (the metadata stays small)
MAX_PIECE = 1 << 26

NVCOMP_ONLY = {"cascaded": "Cascaded", "bitcomp": "Bitcomp", "ans": "ANS", "gdeflate": "GDeflate"}


def piece_bytes(nbytes: int) -> int:
    """Bytes per piece of an ``nbytes`` message: ``PIECE``, or more, so that at most ``MAX_PIECES`` are listed."""
    return max(PIECE, -(-nbytes // MAX_PIECES))


def shuffle(data: Any, width: int) -> Any:
    """Byte ``width``-shuffled bytes of ``data`` (a flat uint8 view when ``width`` is 1)."""
    flat = data.reshape(-1).view("uint8")
    if width == 1:
        return flat
    return flat.reshape(-1, width).T.copy().reshape(-1)


def unshuffle(raw: np.ndarray, width: int, out: np.ndarray) -> None:
    """Write ``raw`` (``shuffle``'s output) into ``out``."""
    target = out.reshape(-1).view(np.uint8)
    if width == 1:
        target[:] = raw
    else:
        target.reshape(-1, width)[:] = raw.reshape(width, -1).T


class Lossless:
    """A byte compressor of ``shuffle``d messages; subclasses give the host library's calls."""

    name = "?"
    lossy = False
    nvcomp_name = "?"

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        self.shuffle = section["shuffle"]
        wanted = section["device"] if device.sends(config, self.name) else "cpu"
        self.device = device.choose(f"compression.{self.name}.device", wanted)

    def encode(self, data: np.ndarray, dtype: str, site: Site | None) -> Encoded | None:
        width = data.itemsize if self.shuffle and data.itemsize > 1 else 1
        piece = piece_bytes(data.nbytes)
        if self.device == "cuda" and data.nbytes:
            with device.stream():
                shuffled = shuffle(device.upload(self.device, data), width)
                sizes, body = nvcomp_gpu.encode_pieces(self.nvcomp_name, shuffled, piece)
        else:
            shuffled = shuffle(data, width)
            parts = [self._compress(shuffled[lo:lo + piece]) for lo in range(0, shuffled.size, piece)]
            sizes, body = [len(b) for b in parts], b"".join(parts)
        meta = _META.pack(_FORMAT, width, piece, len(sizes)) + np.asarray(sizes, "<u4").tobytes()
        return Encoded(body, meta)

    def decode(self, payload: memoryview, meta: bytes, dtype: str, out: np.ndarray) -> None:
        fmt, width, piece, count = _META.unpack_from(meta)
        nbytes = out.nbytes
        if fmt != _FORMAT or width < 1 or nbytes % width or not 1 <= piece <= MAX_PIECE:
            raise ValueError(f"{self.name} metadata names format {fmt}, shuffle width {width}, pieces of {piece} bytes")
        if count != -(-nbytes // piece) or len(meta) != _META.size + 4 * count:
            raise ValueError(f"{self.name} metadata lists {count} pieces of {piece} bytes in {len(meta)} bytes, for "
                             f"a message of {nbytes} bytes")
        sizes = np.frombuffer(meta, "<u4", count, _META.size).tolist()
        if sum(sizes) != len(payload):
            raise ValueError(f"{self.name}: the pieces' sizes add up to {sum(sizes)} bytes, the payload has "
                             f"{len(payload)}")
        raw = np.empty(nbytes, np.uint8)
        at = 0
        for i, size in enumerate(sizes):
            lo = i * piece
            want = min(piece, nbytes - lo)
            got = self._decompress(payload[at:at + size], want)
            if got.size != want:
                raise ValueError(f"{self.name}: {got.size} bytes decoded, expected {want}")
            raw[lo:lo + want] = got
            at += size
        unshuffle(raw, width, out)

    def _compress(self, data: np.ndarray) -> bytes:
        raise NotImplementedError

    def _decompress(self, payload: memoryview, nbytes: int) -> np.ndarray:
        raise NotImplementedError


class Lz4(Lossless):
    name, nvcomp_name = "lz4", "LZ4"

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        super().__init__(config, section)
        import lz4.block

        self._lz4 = lz4.block
        self.acceleration = section["acceleration"]

    def _compress(self, data: np.ndarray) -> bytes:
        return bytes(self._lz4.compress(data, mode="fast", acceleration=self.acceleration, store_size=False))

    def _decompress(self, payload: memoryview, nbytes: int) -> np.ndarray:
        try:
            raw = self._lz4.decompress(payload, uncompressed_size=nbytes)
        except self._lz4.LZ4BlockError as exc:
            raise ValueError(f"lz4: {exc}") from None
        return np.frombuffer(raw, np.uint8)


class Zstd(Lossless):
    name, nvcomp_name = "zstd", "Zstd"

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        super().__init__(config, section)
        import zstandard

        self._zstd = zstandard
        self.level = section["level"]
        self._compressor = zstandard.ZstdCompressor(level=self.level)

    def _compress(self, data: np.ndarray) -> bytes:
        return bytes(self._compressor.compress(data))

    def _decompress(self, payload: memoryview, nbytes: int) -> np.ndarray:
        z = self._zstd
        try:
            size = z.frame_content_size(payload)
            if size not in (-1, nbytes):  # the frame's own claim is checked before anything is allocated
                raise ValueError(f"zstd frame says {size} bytes, expected {nbytes}")
            raw = z.ZstdDecompressor().decompress(payload, max_output_size=nbytes)
        except z.ZstdError as exc:
            raise ValueError(f"zstd: {exc}") from None
        return np.frombuffer(raw, np.uint8)


class Nvcomp:
    """A codec only nvcomp has (``NVCOMP_ONLY``), on the GPU, in nvcomp's chunked format."""

    lossy = False

    def __init__(self, name: str, config: Any, section: dict[str, Any]) -> None:
        self.name, self.algorithm = name, NVCOMP_ONLY[name]
        if device.sends(config, name):
            device.choose(f"compression.{name}.device", section["device"], needs_gpu=True)

    def encode(self, data: np.ndarray, dtype: str, site: Site | None) -> Encoded | None:
        with device.stream():
            flat = device.upload("cuda", data.reshape(-1).view(np.uint8))
            return Encoded(nvcomp_gpu.encode(self.algorithm, flat))

    def decode(self, payload: memoryview, meta: bytes, dtype: str, out: np.ndarray) -> None:
        if not device.gpu_present():
            raise ValueError(f"the payload was compressed with nvcomp's {self.algorithm} on a GPU, and this rank "
                             f"has no usable GPU to decode it ({device.absent()})")
        with device.stream():
            out.reshape(-1).view(np.uint8)[:] = nvcomp_gpu.decode(self.algorithm, payload, out.nbytes)
