"""nvcomp on a CUDA GPU: the only lines of this package that no CPU can run, so CI never has; kept to the
calls themselves. ``algorithm`` is nvcomp's name ("LZ4", "Zstd", "Cascaded", "Bitcomp", "ANS", "GDeflate").
``encode`` and ``decode`` use nvcomp's own chunked format, which only nvcomp decodes; ``encode_pieces`` the
bare format (LZ4 blocks, zstd frames), which the host's lz4 and zstandard libraries read too. Everything
runs on the calling thread's current cupy stream (``device.stream``), with a Codec of its own (nvcomp's
Codec must not be shared between threads).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _codec(algorithm: str, raw: bool) -> tuple[Any, int]:
    """An nvcomp Codec for ``algorithm`` on the calling thread's current stream, and the stream's handle.
    Made per call and dropped on the same thread: a Codec kept in thread-local storage and destroyed as the
    executor's encoding thread ended crashed the process (SIGSEGV, H200, nvcomp 6.0.0)."""
    import cupy
    from nvidia import nvcomp

    stream = cupy.cuda.get_current_stream().ptr
    kind = nvcomp.BitstreamKind.RAW if raw else nvcomp.BitstreamKind.NVCOMP_NATIVE
    return nvcomp.Codec(algorithm=algorithm, bitstream_kind=kind, cuda_stream=stream), stream


def encode(algorithm: str, data: Any) -> np.ndarray:
    """``data`` (a cupy uint8 array) compressed on the GPU; the compressed bytes in host memory."""
    import cupy
    from nvidia import nvcomp

    codec, stream = _codec(algorithm, False)
    out = codec.encode(nvcomp.as_array(data, stream))
    return cupy.asarray(out).view(cupy.uint8).get()


def encode_pieces(algorithm: str, data: Any, piece: int) -> tuple[list[int], np.ndarray]:
    """``data`` (a cupy uint8 array) cut into pieces of ``piece`` bytes, each compressed in the bare format,
    all at once on the GPU: (each piece's compressed size, the pieces one after another in host memory)."""
    import cupy
    from nvidia import nvcomp

    codec, stream = _codec(algorithm, True)
    offsets = list(range(0, data.size, piece))
    batch = nvcomp.as_arrays(data, offsets, [min(piece, data.size - lo) for lo in offsets], stream)
    parts = [cupy.asarray(a).view(cupy.uint8).reshape(-1) for a in codec.encode(batch)]
    return [int(p.size) for p in parts], cupy.concatenate(parts).get()


def decode(algorithm: str, payload: memoryview, nbytes: int) -> np.ndarray:
    """``payload`` decompressed on the GPU into host memory; raises ValueError unless it is ``nbytes``."""
    import cupy
    from nvidia import nvcomp

    codec, stream = _codec(algorithm, False)
    out = codec.decode(nvcomp.as_array(cupy.asarray(np.frombuffer(payload, np.uint8)), stream))
    host = cupy.asarray(out).view(cupy.uint8).get()
    if host.size != nbytes:
        raise ValueError(f"nvcomp {algorithm}: {host.size} bytes decoded, expected {nbytes}")
    return host
