"""Every codec round-trips on the CPU: lossless ones exactly, lossy ones within their stated error, and the
sender's reconstruction (what error feedback subtracts) is exactly what the receiver decodes."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from conftest import make
from erdma_gpucomp import device, lossless, quantize

from erdma_core.sdk import Site

RNG = np.random.default_rng(7)
SITE = Site("buf", "allreduce", "ring", 0, 0, 0)


def gradient(n: int, dtype=np.float32) -> np.ndarray:
    """Gradient-like values: heavy-tailed, spanning orders of magnitude."""
    return (RNG.standard_normal(n) * np.exp(RNG.standard_normal(n) * 2)).astype(dtype)


def roundtrip(codec, data: np.ndarray, dtype: str, site=None) -> np.ndarray:
    enc = codec.encode(data, dtype, site)
    assert enc is not None
    out = np.empty_like(data)
    codec.decode(memoryview(np.frombuffer(enc.payload, np.uint8)), bytes(enc.meta), dtype, out)
    return out


@pytest.mark.parametrize("name", ["lz4", "zstd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int64, np.uint8])
@pytest.mark.parametrize("shuffle", [True, False])
def test_lossless_is_exact(name, dtype, shuffle):
    data = gradient(10_001).astype(dtype)
    out = roundtrip(make(name, shuffle=shuffle), data, np.dtype(dtype).name)
    assert out.tobytes() == data.tobytes()


@pytest.mark.parametrize("name", ["lz4", "zstd"])
def test_lossless_messages_go_in_pieces_that_decode_alone(name):
    """A message of several pieces (the last one short) lists each piece's size in its metadata, and each
    piece is a whole LZ4 block or zstd frame of its own (what a GPU compresses in parallel)."""
    data = gradient(3 * lossless.PIECE // 4 + 1000)
    enc = make(name).encode(data, "float32", None)
    fmt, width, piece, count = struct.unpack_from("<BBII", enc.meta)
    sizes = struct.unpack_from(f"<{count}I", enc.meta, 10)
    assert (fmt, width, piece, count) == (2, 4, lossless.PIECE, 4) and sum(sizes) == len(enc.payload)
    shuffled = lossless.shuffle(data, 4)
    codec = make(name)
    first = codec._decompress(memoryview(bytes(enc.payload))[:sizes[0]], piece)
    assert first.tobytes() == shuffled[:piece].tobytes()
    assert roundtrip(codec, data, "float32").tobytes() == data.tobytes()
    assert roundtrip(codec, data[:0], "float32").size == 0


def test_huge_messages_get_larger_pieces():
    assert lossless.piece_bytes(1 << 20) == lossless.PIECE
    assert lossless.piece_bytes(lossless.PIECE * lossless.MAX_PIECES) == lossless.PIECE
    assert lossless.piece_bytes(lossless.PIECE * lossless.MAX_PIECES + 1) == lossless.PIECE + 1


def test_shuffle_compresses_floats_better():
    """Floats that vary in their low bytes: shuffled, their exponents line up."""
    data = (1.0 + RNG.random(1 << 16) * 1e-3).astype(np.float32)
    plain = len(make("zstd", shuffle=False).encode(data, "float32", None).payload)
    shuffled = len(make("zstd", shuffle=True).encode(data, "float32", None).payload)
    assert shuffled < 0.8 * plain, (shuffled, plain)


# (codec, dtype, bound on |error| relative to the largest magnitude of the message, or of its block)
LOSSY = [
    ("fp16", "float32", 2 ** -11), ("fp16", "float64", 2 ** -11),
    ("bf16", "float32", 2 ** -8), ("bf16", "float64", 2 ** -8),
]


@pytest.mark.parametrize("name, dtype, rel", LOSSY)
def test_casts_round_to_nearest(name, dtype, rel):
    data = gradient(4096, np.float32).astype(dtype) / 100  # within float16's range
    out = roundtrip(make(name), data, dtype)
    subnormal_step = 2.0 ** -25 if name == "fp16" else 0  # half of float16's subnormal spacing
    assert np.all(np.abs(out - data) <= np.maximum(np.abs(data) * rel, subnormal_step))
    assert not np.array_equal(out, data)


def test_fp16_clips_finite_values_and_keeps_inf_and_nan():
    data = np.array([1e6, -1e6, np.inf, -np.inf, np.nan, 1.0], np.float32)
    out = roundtrip(make("fp16"), data, "float32")
    assert out[0] == 65504 and out[1] == -65504 and out[2] == np.inf and out[3] == -np.inf
    assert np.isnan(out[4]) and out[5] == 1.0


def test_bf16_rounds_ties_to_even_and_keeps_nan():
    # 1 + 2^-8 lies halfway between bfloat16's 1 and 1 + 2^-7: the tie goes to the even mantissa (1)
    data = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, np.nan, -0.0], np.float32)
    out = roundtrip(make("bf16"), data, "float32")
    assert out[0] == 1.0 and out[1] == 1 + 2 ** -6 and np.isnan(out[2])
    assert out[3] == 0 and np.signbit(out[3])


@pytest.mark.parametrize("name, bits, block", [("int8", 8, 256), ("int8", 8, 32), ("int4", 4, 64), ("int4", 4, 16)])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_absmax_error_is_within_half_a_step_of_each_block(name, bits, block, dtype):
    n = 5000  # not a multiple of the block: the last block is padded
    x32 = gradient(n)
    if dtype == "bfloat16":
        data = quantize.bf16_bits(np, x32)
    else:
        data = x32.astype(dtype)
    codec = make(name, block=block)
    out = roundtrip(codec, data, dtype)
    x, got = quantize.load(np, data, dtype), quantize.load(np, out, dtype)
    pad = (-n) % block
    top = np.abs(np.concatenate([x, np.zeros(pad, x.dtype)])).reshape(-1, block).max(axis=1)
    step = np.repeat(top / quantize.levels(bits), block)[:n]
    storage_eps = {"float16": 2 ** -11, "bfloat16": 2 ** -8}.get(dtype, 0)  # the result is stored as the dtype
    assert np.all(np.abs(got - x) <= step * 0.5 * (1 + 1e-5) + np.abs(x) * storage_eps * 2)
    enc = codec.encode(data, dtype, None)
    blocks = -(-n // block)
    assert len(enc.payload) == 4 * blocks + (blocks * block if bits == 8 else blocks * block // 2)


def test_int8_sends_about_a_quarter_of_float32():
    data = gradient(1 << 16)
    enc = make("int8").encode(data, "float32", None)
    assert data.nbytes / len(enc.payload) > 3.9


def test_absmax_sends_raw_when_a_block_holds_inf_or_nan():
    data = gradient(1000)
    data[10] = np.inf
    assert make("int8").encode(data, "float32", None) is None
    data[10] = np.nan
    assert make("int4").encode(data, "float32", None) is None


def test_absmax_of_zeros_is_zeros():
    out = roundtrip(make("int8"), np.zeros(300, np.float32), "float32")
    assert np.array_equal(out, np.zeros(300, np.float32))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_topk_sends_the_largest_exactly_and_zeros_the_rest(dtype):
    data = gradient(10_000).astype(dtype)
    out = roundtrip(make("topk", fraction=0.01), data, dtype)
    kept = np.flatnonzero(out)
    assert kept.size == 100
    assert np.array_equal(out[kept], data[kept])
    assert np.abs(data[kept]).min() >= np.abs(np.delete(data, kept)).max()


def test_unhandled_dtypes_go_raw():
    ints = np.arange(1000, dtype=np.int32)
    for name in ("fp16", "bf16", "int8", "int4", "topk"):
        assert make(name).encode(ints, "int32", None) is None
    assert make("fp16").encode(ints.astype(np.float16), "float16", None) is None


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "int4", "topk"])
def test_what_the_sender_keeps_is_what_the_receiver_decodes(name):
    """Error feedback subtracts the sender's reconstruction: it must be the receiver's values, bit for bit."""
    codec = make(name)
    data = gradient(3000)
    out = roundtrip(codec, data, "float32", SITE)
    residual = device.download(codec.feedback._residuals[SITE])  # on the codec's device (a GPU: cupy)
    assert np.array_equal(residual, data - out)


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "int4", "topk"])
def test_a_receiver_decodes_whatever_its_own_settings(name):
    """Block size, k and the like travel in the metadata: a receiver configured otherwise decodes the same."""
    settings = {"int8": {"block": 16}, "int4": {"block": 8}, "topk": {"fraction": 0.3}}.get(name, {})
    sender, receiver = make(name, **settings), make(name, sending=False)
    data = gradient(999)
    enc = sender.encode(data, "float32", None)
    a, b = np.empty_like(data), np.empty_like(data)
    sender.decode(memoryview(np.frombuffer(enc.payload, np.uint8)), enc.meta, "float32", a)
    receiver.decode(memoryview(np.frombuffer(enc.payload, np.uint8)), enc.meta, "float32", b)
    assert a.tobytes() == b.tobytes()


def test_fp16_conversions_give_numpys_bits():
    """The integer-arithmetic casts against numpy's: every float16 decoded; float32 values near every float16,
    halfway cases, subnormals, the clip, inf and nan encoded."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    ours = quantize.fp16_values(np, every)
    assert quantize.from_fp16(np, every).tobytes() == ours.tobytes()
    ref = every.view(np.float16).astype(np.float32)
    same = (ours.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(ours) & np.isnan(ref))
    assert same.all()
    finite = ref[np.isfinite(ref)]
    ups = np.nextafter(finite, np.float32(np.inf))
    downs = np.nextafter(finite, np.float32(-np.inf))
    halfway = (finite[:-1].astype(np.float64) + finite[1:]) / 2
    x = np.concatenate([finite, ups, downs, halfway.astype(np.float32), RNG.standard_normal(100_000).astype(np.float32)
                        * np.float32(10.0) ** RNG.integers(-9, 6, 100_000).astype(np.float32),
                        np.array([65504, 65519, 65520, 1e9, -1e9, 2 ** -25, 2 ** -26, -0.0], np.float32)])
    expect = np.clip(x, -65504, 65504).astype(np.float16).view(np.uint16)
    assert np.array_equal(quantize.to_fp16(np, x), expect)
    special = quantize.to_fp16(np, np.array([np.inf, -np.inf, np.nan], np.float32))
    assert list(special[:2]) == [0x7C00, 0xFC00] and (special[2] & 0x7C00) == 0x7C00 and special[2] & 0x3FF
