"""Entry point ``erdma.plugins: gpucomp``: registers the compressors and their options. Importing it is cheap:
numpy, cupy, lz4, zstandard and nvcomp are imported only when a job selects or receives a codec."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from erdma_core.sdk import Check, Config, Option, Register, hookimpl

DEVICE = Option(str, "auto", "where this rank encodes: auto (a CUDA GPU when cupy sees one, else the CPU), cpu, "
                "cuda (refused without a GPU)", choices=("auto", "cpu", "cuda"))
FEEDBACK = {
    "error_feedback": Option(bool, True, "add what each encode lost to the next encode of the same buffer range "
                             "(error feedback); off: the loss is dropped"),
    "feedback_max_bytes": Option(int, 4 << 30, "bound on the residuals error feedback keeps (the oldest go first)",
                                 minimum=0),
}


def _lazy(module: str, cls_name: str, *args: str) -> Callable[[Any, dict[str, Any]], Any]:
    """A factory that imports ``module`` (numpy, lz4, ...) only when a job makes the codec."""
    def make(config: Config, section: dict[str, Any]) -> Any:
        import importlib

        cls = getattr(importlib.import_module(f".{module}", __package__), cls_name)
        return cls(*args, config, section)

    return make


def _check(needs_gpu: bool = False) -> Callable[[Any, dict[str, Any]], None]:
    """The codec's rules at load (``register(..., check=)``): where it encodes is possible here; int4's block
    is even (two codes per byte)."""
    def check(config: Config, section: dict[str, Any]) -> None:
        from erdma_core.sdk import ConfigError

        from .device import choose

        name = config["compression.name"]
        if name == "int4" and section["block"] % 2:
            raise ConfigError(f"config key 'compression.int4.block': value {section['block']} is odd; int4 packs "
                              "two codes per byte, so the block must be even")
        choose(f"compression.{name}.device", section["device"], needs_gpu=needs_gpu)

    return check


CHECK = _check()


def _block(default: int) -> Option:
    return Option(int, default, "elements per scale: smaller blocks follow the data more closely and send more "
                  "scales (4 bytes each)", minimum=2, maximum=1 << 20)


def _shuffle() -> Option:
    return Option(bool, True, "byte-shuffle multi-byte elements before compressing (floats compress better)")


def make(name: str, *, sending: bool = True, **settings: Any) -> Any:
    """The compressor ``name`` outside a job (benchmarks, tests): its registered defaults, ``settings`` over
    them, as the rank that sends with it (``sending=False``: a rank that only decodes it)."""
    made: dict[str, tuple[Any, dict[str, Option]]] = {}

    def register(name: str, factory: Callable[..., Any], *, options: Mapping[str, Option] | None = None,
                 description: str = "", sdk: int | None = None, check: Check | None = None) -> None:
        made[name] = (factory, dict(options or {}))

    erdma_register_compressors(register)
    factory, options = made[name]
    section = {key: opt.default for key, opt in options.items()} | settings
    return factory({"compression.name": name if sending else "none"}, section)


@hookimpl
def erdma_register_compressors(register: Register) -> None:
    lossy = {"device": DEVICE, **FEEDBACK}
    register("fp16", _lazy("lossy", "Fp16"), options=lossy,
             description="float32/float64 as float16 (2x or 4x fewer bytes), error feedback", sdk=2,
             check=CHECK)
    register("bf16", _lazy("lossy", "Bf16"), options=lossy,
             description="float32/float64 as bfloat16 (float32's range, 8-bit mantissa), error feedback", sdk=2,
             check=CHECK)
    register("int8", _lazy("lossy", "Int8"), options={**lossy, "block": _block(256)},
             description="blockwise absmax int8 (about 3.9x fewer bytes than float32), error feedback", sdk=2,
             check=CHECK)
    register("int4", _lazy("lossy", "Int4"), options={**lossy, "block": _block(64)},
             description="blockwise absmax int4 (about 7x fewer bytes than float32), error feedback", sdk=2,
             check=CHECK)
    register("topk", _lazy("lossy", "TopK"), options={**lossy, "fraction": Option(
        float, 0.01, "share of elements sent (those of largest magnitude); the rest wait in error feedback",
        minimum=1e-6, maximum=0.5)}, description="top-k sparsification (index, value pairs), error feedback", sdk=2,
        check=CHECK)
    register("lz4", _lazy("lossless", "Lz4"), options={"device": DEVICE, "shuffle": _shuffle(), "acceleration": Option(
        int, 1, "LZ4's acceleration on the CPU: higher is faster and compresses less", minimum=1, maximum=65537)},
        description="lossless LZ4 (CPU: python-lz4; GPU: nvcomp), byte shuffle", sdk=2, check=CHECK)
    register("zstd", _lazy("lossless", "Zstd"), options={"device": DEVICE, "shuffle": _shuffle(), "level": Option(
        int, 1, "zstd level on the CPU (1 fastest ... 22 smallest)", minimum=-7, maximum=22)},
        description="lossless zstd (CPU: zstandard; GPU: nvcomp), byte shuffle", sdk=2, check=CHECK)
    gpu = {"device": Option(str, "cuda", "nvcomp-only codecs run on a CUDA GPU", choices=("cuda", "auto"))}
    for name, what in (("cascaded", "run-length, delta and bit-packing"), ("bitcomp", "bit-packing of numbers"),
                       ("ans", "asymmetric numeral systems"), ("gdeflate", "GPU deflate")):
        register(name, _lazy("lossless", "Nvcomp", name), options=gpu, description=f"lossless nvcomp {what}; GPU only",
                 sdk=2, check=_check(needs_gpu=True))
