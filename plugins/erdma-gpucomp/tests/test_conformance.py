"""Every codec of erdma-gpucomp that runs on the CPU passes the core's compressor conformance kit."""

from __future__ import annotations

from typing import Any, ClassVar

from erdma_core.testing.compressor_conformance import CompressorConformance


class TestFp16(CompressorConformance):
    compressor, encodes, tolerance = "fp16", ("float32", "float64"), 1e-3


class TestBf16(CompressorConformance):
    compressor, encodes, tolerance = "bf16", ("float32", "float64"), 5e-3


class TestInt8(CompressorConformance):
    compressor, encodes, tolerance = "int8", ("float16", "bfloat16", "float32", "float64"), 0.02


class TestInt4(CompressorConformance):
    compressor, encodes, tolerance = "int4", ("float16", "bfloat16", "float32", "float64"), 0.25


class TestTopK(CompressorConformance):
    compressor, encodes, tolerance = "topk", ("float16", "bfloat16", "float32", "float64"), 1.0
    settings: ClassVar[dict[str, Any]] = {"fraction": 0.05}


class TestLz4(CompressorConformance):
    compressor, encodes = "lz4", ()  # random gradients do not shrink: it may send them raw


class TestZstd(CompressorConformance):
    compressor, encodes = "zstd", ()
