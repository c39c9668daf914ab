"""The lossy compressors: ``fp16`` and ``bf16`` casts, blockwise absmax ``int8`` and ``int4``, and ``topk``
sparsification, each with error feedback per Site (``feedback``).

Encoding runs on the codec's device (``device``: the message is uploaded, encoded by ``quantize``'s
array-API code, and its encoding downloaded); decoding runs where the message lands (host memory). Each
encoding carries what its decoder needs (block size, bits, k) in its metadata, so a receiver decodes it
whatever its own config says. A dtype a codec does not handle, or a block holding inf or nan, goes raw (and
the residual stays for the next step).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from erdma_core.sdk import ConfigError, Encoded, Site

from . import device, quantize
from .feedback import ErrorFeedback

STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "float64": np.float64}
_ABSMAX = struct.Struct("<BI")  # bits, block
_TOPK = struct.Struct("<I")  # k
Parts = tuple[list[Any], bytes, Any]  # (arrays to send in order, metadata, working values the receiver gets)


def _bytes(xp: Any, parts: list[Any]) -> np.ndarray:
    """The parts, joined as bytes, in host memory (one download)."""
    return device.download(xp.concatenate([p.reshape(-1).view(xp.uint8) for p in parts]))


def _frombuffer(payload: memoryview, dtype: Any, count: int, offset: int = 0) -> np.ndarray:
    return np.frombuffer(payload, dtype, count, offset)


class Lossy:
    """What every lossy codec shares: the device, error feedback and the encode/decode frame around a
    codec's ``_encode(xp, x, dtype)`` and ``_decode(payload, meta, dtype, n)``."""

    name = "?"
    lossy = True
    dtypes: tuple[str, ...] = quantize.FLOATS

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        wanted = section["device"] if device.sends(config, self.name) else "cpu"
        self.device = device.choose(f"compression.{self.name}.device", wanted)
        self.xp = device.module(self.device)
        self.feedback = ErrorFeedback(section["feedback_max_bytes"]) if section["error_feedback"] else None

    def encode(self, data: np.ndarray, dtype: str, site: Site | None) -> Encoded | None:
        if dtype not in self.dtypes or data.size == 0:
            return None
        xp = self.xp
        with device.computing(self.device):
            x = quantize.load(xp, device.upload(self.device, data), dtype)
            fb = self.feedback if site is not None else None
            if fb is not None:
                x = fb.take(site, x)
            out = self._encode(xp, x, dtype)
            if out is None:
                return None
            parts, meta, recon = out
            if fb is not None:
                fb.keep(site, x - quantize.seen(xp, recon, dtype))
            return Encoded(_bytes(xp, parts), meta)

    def decode(self, payload: memoryview, meta: bytes, dtype: str, out: np.ndarray) -> None:
        if dtype not in self.dtypes:
            raise ValueError(f"{self.name} does not encode {dtype}")
        out[:] = quantize.store(np, self._decode(payload, meta, dtype, out.size), dtype)

    def _encode(self, xp: Any, x: Any, dtype: str) -> Parts | None:
        raise NotImplementedError

    def _decode(self, payload: memoryview, meta: bytes, dtype: str, n: int) -> np.ndarray:
        raise NotImplementedError


def _expect(payload: memoryview, nbytes: int, what: str) -> None:
    if len(payload) != nbytes:
        raise ValueError(f"{what}: payload of {len(payload)} bytes, expected {nbytes}")


class Cast(Lossy):
    """float32/float64 sent as 16-bit floats: ``to_bits`` makes their uint16 bits, ``from_bits`` reads them."""

    dtypes = ("float32", "float64")
    to_bits = from_bits = staticmethod(lambda xp, x: x)

    def _encode(self, xp: Any, x: Any, dtype: str) -> Parts:
        bits = self.to_bits(xp, x.astype(xp.float32))
        return [bits], b"", self.from_bits(xp, bits).astype(x.dtype)

    def _decode(self, payload: memoryview, meta: bytes, dtype: str, n: int) -> np.ndarray:
        _expect(payload, 2 * n, self.name)
        return self.from_bits(np, _frombuffer(payload, np.uint16, n))  # type: ignore[no-any-return]


class Fp16(Cast):
    """float16 (finite values clipped to +-65504; inf and nan kept)."""

    name = "fp16"
    to_bits, from_bits = staticmethod(quantize.to_fp16), staticmethod(quantize.from_fp16)


class Bf16(Cast):
    """bfloat16 (rounded to nearest even): float32's range, 8 bits of mantissa."""

    name = "bf16"
    to_bits, from_bits = staticmethod(quantize.bf16_bits), staticmethod(quantize.from_bf16_bits)


class Absmax(Lossy):
    """Blockwise absmax quantization: each block of ``block`` elements sends one float32 scale (its largest
    magnitude over the top code) and a signed code per element: ``int8`` (codes -127..127) or ``int4``
    (-7..7, two per byte)."""

    bits = 8

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        super().__init__(config, section)
        self.block = section["block"]
        if self.bits == 4 and self.block % 2:
            raise ConfigError(f"config key 'compression.{self.name}.block': value {self.block} is odd; int4 packs "
                              "two codes per byte, so the block must be even")

    def _encode(self, xp: Any, x: Any, dtype: str) -> Parts | None:
        q = quantize.absmax(xp, x, self.block, self.bits)
        if q is None:
            return None
        scale, codes = q
        recon = quantize.unabsmax(xp, scale, codes, x.size, self.block)
        packed = quantize.pack4(xp, codes) if self.bits == 4 else codes
        return [scale, packed], _ABSMAX.pack(self.bits, self.block), recon

    def _decode(self, payload: memoryview, meta: bytes, dtype: str, n: int) -> np.ndarray:
        bits, block = _ABSMAX.unpack(meta)
        if bits not in (4, 8) or block < 1 or (bits == 4 and block % 2):
            raise ValueError(f"absmax metadata names {bits} bits in blocks of {block}")
        blocks = math.ceil(n / block)
        code_bytes = blocks * block if bits == 8 else blocks * block // 2
        _expect(payload, 4 * blocks + code_bytes, f"int{bits}")
        scale = _frombuffer(payload, np.float32, blocks)
        raw = _frombuffer(payload, np.uint8 if bits == 4 else np.int8, code_bytes, 4 * blocks)
        codes = quantize.unpack4(np, raw, blocks * block) if bits == 4 else raw
        return quantize.unabsmax(np, scale, codes, n, block)


class Int8(Absmax):
    name, bits = "int8", 8


class Int4(Absmax):
    name, bits = "int4", 4


class TopK(Lossy):
    """The ``fraction`` of elements of largest magnitude, as (index, value) pairs; the rest arrive as zero
    (error feedback carries them into later steps)."""

    name = "topk"

    def __init__(self, config: Any, section: dict[str, Any]) -> None:
        super().__init__(config, section)
        self.fraction = section["fraction"]

    def _encode(self, xp: Any, x: Any, dtype: str) -> Parts:
        k = max(1, math.ceil(x.size * self.fraction))
        idx, values = quantize.topk(xp, x, k)
        sent = quantize.store(xp, values, dtype)
        recon = quantize.untopk(xp, idx, quantize.load(xp, sent, dtype), x.size)
        return [idx, sent], _TOPK.pack(k), recon

    def _decode(self, payload: memoryview, meta: bytes, dtype: str, n: int) -> np.ndarray:
        (k,) = _TOPK.unpack(meta)
        storage = np.dtype(STORAGE[dtype])
        if not 1 <= k <= n:
            raise ValueError(f"topk metadata names {k} elements of {n}")
        _expect(payload, k * (4 + storage.itemsize), "topk")
        idx = _frombuffer(payload, np.uint32, k)
        if int(idx.max()) >= n:
            raise ValueError(f"topk index {int(idx.max())} is outside the {n} elements")
        values = quantize.load(np, _frombuffer(payload, storage, k, 4 * k), dtype)
        return quantize.untopk(np, idx, values, n)
