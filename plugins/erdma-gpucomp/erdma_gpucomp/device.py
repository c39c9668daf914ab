"""Where a codec computes: ``cpu`` (numpy) or ``cuda`` (cupy), picked once per compressor from its
``device`` option. The GPU-only lines of the lossy codecs are here: the upload of a message and the download
of its encoding (everything between them is ``quantize``'s array-API code, which CI runs on numpy).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
import threading
from typing import Any

import numpy as np

from erdma_core.sdk import ConfigError

DEVICES = ("auto", "cpu", "cuda")


_state = {"used": False, "forked": False}  # this process ran cupy; it is a child forked after that


def _forked() -> None:
    if _state["used"]:
        _state["forked"] = True
        gpu_present.cache_clear()


os.register_at_fork(after_in_child=_forked)


def _nvml_devices() -> int:
    """GPUs the NVIDIA driver reports, through NVML: unlike asking CUDA, this leaves the process free to fork
    ranks that use the GPU (a CUDA context does not survive a fork)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    if nvml.nvmlInit_v2() != 0:
        return 0
    try:
        count = ctypes.c_uint(0)
        return count.value if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else 0
    finally:
        nvml.nvmlShutdown()


@functools.cache
def gpu_present() -> bool:
    """A CUDA device cupy can use: cupy installed, the driver reports a GPU (NVML, without initialising CUDA
    here), ``CUDA_VISIBLE_DEVICES`` does not hide them all, and this process is not a child forked after its
    parent ran cupy (CUDA cannot be used there)."""
    if _state["forked"] or importlib.util.find_spec("cupy") is None:
        return False
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return _nvml_devices() > 0


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
                              f"({absent()}); the codecs fp16, bf16, int8, int4, "
                              "topk, lz4 and zstd run on the CPU")
        return "cuda"
    return "cuda" if wanted == "auto" and gpu_present() else "cpu"


def absent() -> str:
    """Why ``gpu_present()`` is False, in words."""
    if _state["forked"]:
        return "this process was forked after its parent ran CUDA code; start ranks with erdma run or " \
               "multiprocessing's spawn"
    return "cupy missing, no GPU reported by the NVIDIA driver, or CUDA_VISIBLE_DEVICES hides them"


def module(device: str) -> Any:
    """numpy or cupy."""
    if device == "cuda":
        import cupy

        _state["used"] = True

        return cupy
    return np


def upload(device: str, data: np.ndarray) -> Any:
    """``data`` (host) on ``device``."""
    if device == "cuda":
        import cupy

        _state["used"] = True
        return cupy.asarray(data)  # GPU only: never run in CI
    return data


_local = threading.local()


def stream() -> Any:
    """This thread's own CUDA stream, made on first use (``with device.stream():`` makes it current). It does
    not wait for the legacy default stream, where a training loop's kernels may run, and the executor's
    encoding thread gets one of its own. Every encode ends with a download, which waits for its stream, so
    residuals one thread's stream wrote are complete before another thread reads them."""
    made = _local.__dict__.get("stream")
    if made is None:
        import cupy

        made = _local.stream = cupy.cuda.Stream(non_blocking=True)
    return made


def computing(device: str) -> contextlib.AbstractContextManager[Any]:
    """Where a codec on ``device`` computes: this thread's stream for "cuda" (``stream``), nothing for "cpu"."""
    return stream() if device == "cuda" else contextlib.nullcontext()


def download(arr: Any) -> np.ndarray:
    """A host copy of ``arr`` (numpy arrays pass through)."""
    if isinstance(arr, np.ndarray):
        return arr
    return arr.get()  # GPU only: never run in CI
