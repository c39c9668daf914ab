"""Where a codec computes: ``cpu`` (numpy) or ``cuda`` (cupy), picked once per compressor from its
``device`` option. The GPU-only lines of the lossy codecs are here: the upload of a message and the download
of its encoding (everything between them is ``quantize``'s array-API code, which CI runs on numpy).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from erdma_core.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


@functools.cache
def gpu_present() -> bool:
    """A CUDA device cupy can use (cupy imported only here, and only when a codec asks)."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:  # a driver that is there but broken counts as none
        return False


def sends(config: Any, name: str) -> bool:
    """Whether this rank sends with the compressor ``name`` (otherwise its instance only decodes, on the host,
    and its device settings do not apply)."""
    try:
        return bool(config["compression.name"] == name)
    except (KeyError, TypeError):
        return False


def choose(key: str, wanted: str, *, needs_gpu: bool = False) -> str:
    """The device for config key ``key`` = ``wanted``: "cuda" or "cpu"; a GPU that is wanted (or that the
    codec cannot run without) and absent is refused, naming the key."""
    if wanted not in DEVICES:
        raise ConfigError(f"config key {key!r}: invalid value {wanted!r}; valid choices: {', '.join(DEVICES)}")
    if wanted == "cpu" and needs_gpu:
        raise ConfigError(f"config key {key!r}: value 'cpu' is not possible: this codec runs only on a GPU (nvcomp)")
    if wanted == "cuda" or needs_gpu:
        if not gpu_present():
            raise ConfigError(f"config key {key!r}: value {wanted!r} needs a CUDA GPU with cupy "
                              "(pip install 'erdma-gpucomp[gpu]'), and none is usable here "
                              "(cupy missing or cupy.is_available() is False); the codecs fp16, bf16, int8, int4, "
                              "topk, lz4 and zstd run on the CPU")
        return "cuda"
    return "cuda" if wanted == "auto" and gpu_present() else "cpu"


def module(device: str) -> Any:
    """numpy or cupy."""
    if device == "cuda":
        import cupy

        return cupy
    return np


def upload(device: str, data: np.ndarray) -> Any:
    """``data`` (host) on ``device``."""
    if device == "cuda":
        import cupy

        return cupy.asarray(data)  # GPU only: never run in CI
    return data


def download(arr: Any) -> np.ndarray:
    """A host copy of ``arr`` (numpy arrays pass through)."""
    if isinstance(arr, np.ndarray):
        return arr
    return arr.get()  # GPU only: never run in CI
