"""Turning what users pass (numpy arrays, buffer-protocol objects, DLPack producers such as torch CPU
tensors) into flat numpy views that share their memory, plus the write-back for the rare copy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..protocol import dtypes


class Buffer:
    """A flat, C-contiguous view of a user's tensor; ``commit()`` writes back when a copy was needed."""

    __slots__ = ("_commit", "array", "dtype")

    def __init__(self, array: np.ndarray, dtype: str, commit: Callable[[], None] | None = None) -> None:
        self.array, self.dtype, self._commit = array, dtype, commit

    @property
    def copied(self) -> bool:
        """The array is a copy of the user's tensor: ``commit()`` writes it back."""
        return self._commit is not None

    @property
    def write_back(self) -> Callable[[], None] | None:
        """What ``commit()`` runs: None when the array is the user's own memory (nothing to write back)."""
        return self._commit

    def commit(self) -> None:
        if self._commit is not None:
            self._commit()


PAGE = 4096


def page_aligned(nbytes: int) -> np.ndarray:
    """``nbytes`` of uint8 starting on a 4 KiB boundary, for memory the engine lends to receives. Copies
    into memory that starts 1-31 bytes past the source modulo 4 KiB run many times slower on some AMD cores
    (glibc's memcpy and the kernel's copy to user space both use ``rep movsb``), and malloc puts one array
    16 bytes past the previous one modulo 4 KiB whenever that one is a whole number of pages: a 64 KiB
    receive into scratch memory placed so took 100 us instead of 55-65 (2 ranks, loopback)."""
    raw = np.empty(nbytes + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start:start + nbytes]


def _torch_view(t: Any) -> tuple[np.ndarray, str]:
    import torch

    if t.device.type != "cpu":
        raise TypeError(f"tensor on {t.device} given to a transport that moves host memory; "
                        "use a CPU tensor or a GPU-capable transport")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    arr = t.numpy()
    return arr, dtypes.name_for_numpy(arr.dtype)


def flat(arr: np.ndarray, dtype: str) -> np.ndarray:
    """The flat view ``as_buffer`` made of ``arr``, a C-contiguous numpy array it found to be of ``dtype``
    (an ml_dtypes bfloat16 array as its uint16 bits)."""
    if dtype == "bfloat16":
        arr = arr.view(np.uint16)
    return arr if arr.ndim == 1 else arr.reshape(-1)


def as_buffer(obj: Any, what: str = "tensor", *, writable: bool = True) -> Buffer:
    """Wrap ``obj`` as a flat Buffer of a supported dtype, or raise TypeError naming what is wrong."""
    if type(obj) is np.ndarray:
        arr = obj
        name = dtypes.name_for_numpy(arr.dtype)
        if name == "bfloat16":  # ml_dtypes' bfloat16: move its bits
            arr = arr.view(np.uint16)
    elif type(obj).__module__.startswith("torch"):
        arr, name = _torch_view(obj)
    elif isinstance(obj, np.ndarray):
        arr = obj
        name = dtypes.name_for_numpy(arr.dtype)
        if name == "bfloat16":  # ml_dtypes' bfloat16: move its bits
            arr = arr.view(np.uint16)
    elif hasattr(obj, "__dlpack__"):
        arr = np.from_dlpack(obj)
        name = dtypes.name_for_numpy(arr.dtype)
    else:
        try:
            arr = np.asarray(memoryview(obj))
        except TypeError:
            raise TypeError(f"{what}: expected a numpy array, a torch CPU tensor, a DLPack producer or a "
                            f"buffer-protocol object, got {type(obj).__name__}") from None
        name = dtypes.name_for_numpy(arr.dtype)
    flags = arr.flags
    if writable and not flags.writeable:
        raise ValueError(f"{what}: the buffer is read-only, but this op writes its result into it")
    if flags.c_contiguous:
        return Buffer(arr if arr.ndim == 1 else arr.reshape(-1), name)
    flat = np.ascontiguousarray(arr).reshape(-1)

    def commit() -> None:
        arr[...] = flat.reshape(arr.shape)

    return Buffer(flat, name, commit)
