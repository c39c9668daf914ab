"""nvcomp on a CUDA GPU: the only lines of this package that no CPU can run, so CI never has; kept to the
calls themselves. ``algorithm`` is nvcomp's name ("LZ4", "Zstd", "Cascaded", "Bitcomp", "ANS", "GDeflate").
``raw=True`` asks for the bare format (an LZ4 block, a zstd frame), which the host's lz4 and zstandard
libraries read and write too; otherwise nvcomp's own chunked format, which only nvcomp decodes.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _codec(algorithm: str, raw: bool) -> Any:
    from nvidia import nvcomp

    kind = nvcomp.BitstreamKind.RAW if raw else nvcomp.BitstreamKind.NVCOMP_NATIVE
    return nvcomp.Codec(algorithm=algorithm, bitstream_kind=kind)


def encode(algorithm: str, data: Any, raw: bool) -> np.ndarray:
    """``data`` (a cupy uint8 array) compressed on the GPU; the compressed bytes in host memory."""
    import cupy
    from nvidia import nvcomp

    out = _codec(algorithm, raw).encode(nvcomp.as_array(data))
    return cupy.asarray(out).view(cupy.uint8).get()


def decode(algorithm: str, payload: memoryview, nbytes: int, raw: bool) -> np.ndarray:
    """``payload`` decompressed on the GPU into host memory; raises ValueError unless it is ``nbytes``."""
    import cupy
    from nvidia import nvcomp

    out = _codec(algorithm, raw).decode(nvcomp.as_array(cupy.asarray(np.frombuffer(payload, np.uint8))))
    host = cupy.asarray(out).view(cupy.uint8).get()
    if host.size != nbytes:
        raise ValueError(f"nvcomp {algorithm}: {host.size} bytes decoded, expected {nbytes}")
    return host
