"""The GPU paths (cupy kernels, nvcomp): run where a CUDA GPU is usable, skipped elsewhere with the reason.
On a GPU, every codec encodes on the device and its encoding decodes on the host to the bits the CPU codec's
decoder gives, and lz4/zstd payloads cross between a GPU sender and a CPU receiver both ways."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make
from erdma_gpucomp import device

pytestmark = pytest.mark.skipif(not device.gpu_present(),
                                reason=f"no usable CUDA GPU ({device.absent()})")
RNG = np.random.default_rng(11)


def data(n: int = 1 << 20) -> np.ndarray:
    return (RNG.standard_normal(n) * np.exp(RNG.standard_normal(n))).astype(np.float32)


def decoded(codec, enc, like: np.ndarray) -> np.ndarray:
    out = np.empty_like(like)
    codec.decode(memoryview(np.frombuffer(enc.payload, np.uint8)), bytes(enc.meta), "float32", out)
    return out


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "int4", "topk"])
def test_lossy_codecs_encode_on_the_gpu_as_on_the_cpu(name):
    x = data()
    gpu, cpu = make(name, device="cuda"), make(name, device="cpu")
    assert gpu.device == "cuda"
    g, c = decoded(cpu, gpu.encode(x, "float32", None), x), decoded(cpu, cpu.encode(x, "float32", None), x)
    # division and rounding may differ in the last place on the device: bounded by one quantization step
    assert np.abs(g - c).max() <= np.abs(x).max() / 7


@pytest.mark.parametrize("name", ["lz4", "zstd"])
def test_lossless_payloads_cross_between_gpu_and_cpu(name):
    x = data()
    gpu, cpu = make(name, device="cuda"), make(name, device="cpu")
    assert decoded(cpu, gpu.encode(x, "float32", None), x).tobytes() == x.tobytes()
    assert decoded(gpu, cpu.encode(x, "float32", None), x).tobytes() == x.tobytes()


@pytest.mark.parametrize("name", ["cascaded", "bitcomp", "ans", "gdeflate"])
def test_nvcomp_only_codecs_round_trip(name):
    x = data()
    codec = make(name)
    assert decoded(codec, codec.encode(x, "float32", None), x).tobytes() == x.tobytes()
