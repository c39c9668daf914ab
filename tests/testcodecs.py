"""Compressors for the tests, installed as a plugin distribution by the ``codec_plugin`` fixture:

* ``fp16``: float32/float64 cast to float16 (lossy; idempotent: a decoded value encodes to itself).
* ``int8``: blockwise absmax int8 with error feedback per Site (lossy and not idempotent: decoding and
  encoding again may change values, so only forwarding encoded bytes as they came keeps ranks identical).
* ``zlib``: lossless.
* ``fails``: lossless until its ``FAILS_AT``-th encode in a process, which raises.
* ``slow``: lossless; its ``SLOW_AT``-th encode in a process first sleeps ``SLOW_S`` seconds.

Every encode is counted in ``CALLS`` (per process) so tests can see that the executor used them, and in
``THREADS`` by the name of the thread that ran it (the executor's helper thread is ``erdma-encode_0``).
"""

from __future__ import annotations

import collections
import threading
import time
import zlib
from typing import Any

import numpy as np

from erdma_core import hookimpl
from erdma_core.compression import Encoded, Site

CALLS: collections.Counter[str] = collections.Counter()
THREADS: collections.Counter[str] = collections.Counter()
FAILS_AT = 3
SLOW_AT, SLOW_S = 3, 0.0
SITES: list[Site | None] = []
_BLOCK = 64


class Fp16:
    name, lossy = "fp16", True

    def __init__(self, config: Any = None, section: Any = None) -> None:
        pass

    def encode(self, data: np.ndarray, dtype: str, site: Site | None) -> Encoded | None:
        if dtype not in ("float32", "float64"):
            return None
        CALLS["fp16"] += 1
        return Encoded(data.astype(np.float16))

    def decode(self, payload: memoryview, meta: bytes, dtype: str, out: np.ndarray) -> None:
        out[:] = np.frombuffer(payload, np.float16)


class Int8:
    name, lossy = "int8", True

    def __init__(self, config: Any = None, section: Any = None) -> None:
        self.residuals: dict[Site, np.ndarray] = {}

    def encode(self, data: np.ndarray, dtype: str, site: Site | None) -> Encoded | None:
        if dtype != "float32":
            return None
        CALLS["int8"] += 1
        THREADS[threading.current_thread().name] += 1
        SITES.append(site)
        x = data.astype(np.float32)
        if site is not None and site in self.residuals:
            x = x + self.residuals[site]
        pad = (-x.size) % _BLOCK
        blocks = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(-1, _BLOCK)
        scale = np.abs(blocks).max(axis=1) / 127
        scale[scale == 0] = 1
        q = np.clip(np.rint(blocks / scale[:, None]), -127, 127).astype(np.int8)
        if site is not None:
            self.residuals[site] = x - (q * scale[:, None]).reshape(-1)[:x.size]
        return Encoded(q.tobytes(), scale.astype(np.float32).tobytes())

    def decode(self, payload: memoryview, meta: bytes, dtype: str, out: np.ndarray) -> None:
        scale = np.frombuffer(meta, np.float32)
        q = np.frombuffer(payload, np.int8).reshape(-1, _BLOCK)
        out[:] = (q * scale[:, None]).reshape(-1)[:out.size]


class Zlib:
    name, lossy = "zlib", False

    def __init__(self, config: Any = None, section: Any = None) -> None:
        pass

    def encode(self, data: np.ndarray, dtype: str, site: Site | None) -> Encoded | None:
        CALLS[self.name] += 1
        THREADS[threading.current_thread().name] += 1
        return Encoded(zlib.compress(data.tobytes(), 1))

    def decode(self, payload: memoryview, meta: bytes, dtype: str, out: np.ndarray) -> None:
        out.view(np.uint8)[:] = np.frombuffer(zlib.decompress(payload), np.uint8)


class Fails(Zlib):
    name = "fails"

    def encode(self, data: np.ndarray, dtype: str, site: Site | None) -> Encoded | None:
        if CALLS[self.name] + 1 == FAILS_AT:
            raise RuntimeError(f"encode number {FAILS_AT} fails")
        return super().encode(data, dtype, site)


class Slow(Zlib):
    name = "slow"

    def encode(self, data: np.ndarray, dtype: str, site: Site | None) -> Encoded | None:
        if CALLS[self.name] + 1 == SLOW_AT:
            time.sleep(SLOW_S)
        return super().encode(data, dtype, site)


@hookimpl
def erdma_register_compressors(register: Any) -> None:
    for cls in (Fp16, Int8, Zlib, Fails, Slow):
        register(cls.name, cls)


def calls(pg: Any) -> dict[str, int]:
    return dict(CALLS)


def threads(pg: Any) -> dict[str, int]:
    return dict(THREADS)
