"""The lossless compressors.

``lz4`` and ``zstd`` run on the CPU (python-lz4, zstandard) or on a GPU (nvcomp, bare format), and both
write the same format: the message's bytes, byte-shuffled for multi-byte dtypes (all first bytes of the
elements, then all second bytes, ...: the exponents of floats end up side by side, which is what compresses),
as one LZ4 block or one zstd frame. So a CPU decodes what a GPU encoded and the other way round.
``cascaded``, ``bitcomp``, ``ans`` and ``gdeflate`` exist only in nvcomp: only a rank with a GPU sends them,
and only a rank with a GPU can decode them.

Nothing is allocated on the sender's word: the decoded size must be the receiver's own message size, and
decompression is bounded by it.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from erdma_core.compression import Encoded, Site

from . import device, nvcomp_gpu

_META = struct.Struct("<BB")  # format (1), shuffle width in bytes (1: none)
_FORMAT = 1
NVCOMP_ONLY = {"cascaded": "Cascaded", "bitcomp": "Bitcomp", "ans": "ANS", "gdeflate": "GDeflate"}


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
        shuffled = shuffle(device.upload(self.device, data), width)
        if self.device == "cuda":
            body: Any = nvcomp_gpu.encode(self.nvcomp_name, shuffled, raw=True)
        else:
            body = self._compress(shuffled)
        return Encoded(body, _META.pack(_FORMAT, width))

    def decode(self, payload: memoryview, meta: bytes, dtype: str, out: np.ndarray) -> None:
        fmt, width = _META.unpack(meta)
        if fmt != _FORMAT or width < 1 or out.nbytes % width:
            raise ValueError(f"{self.name} metadata names format {fmt}, shuffle width {width}")
        raw = self._decompress(payload, out.nbytes)
        if raw.size != out.nbytes:
            raise ValueError(f"{self.name}: {raw.size} bytes decoded, expected {out.nbytes}")
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
        flat = device.upload("cuda", data.reshape(-1).view(np.uint8))
        return Encoded(nvcomp_gpu.encode(self.algorithm, flat, raw=False))

    def decode(self, payload: memoryview, meta: bytes, dtype: str, out: np.ndarray) -> None:
        if not device.gpu_present():
            raise ValueError(f"the payload was compressed with nvcomp's {self.algorithm} on a GPU, and this rank "
                             "has no usable GPU to decode it (cupy missing or cupy.is_available() is False)")
        out.reshape(-1).view(np.uint8)[:] = nvcomp_gpu.decode(self.algorithm, payload, out.nbytes, raw=False)
