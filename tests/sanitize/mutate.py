"""What the sanitizer step's drivers share: their arguments, the sanitized shim loaded in place of the
installed one, the corpus files (hex, one input a line, ``#`` comments) and deterministic mutations of their
inputs: what a fuzzer's first rounds try (bits flipped, cut short, grown, bytes spliced from another input,
1-, 2- and 4-byte fields set to their extremes)."""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
from pathlib import Path


def arguments() -> argparse.Namespace:
    """``BUILT CORPUS [--mutations N] [--seed S]``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("built", type=Path, help="what build.py built")
    ap.add_argument("corpus", type=Path, help="the corpus folder")
    ap.add_argument("--mutations", type=int, default=40, help="mutations of each corpus input")
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def load(built: Path, module: str) -> None:
    """The sanitized cffi module ``module`` (``erdma_quic.ngtcp2._shim``) from ``built``, in its place."""
    path = next(built.joinpath(*module.split(".")[:-1]).glob(f"{module.rsplit('.', 1)[1]}*.so"))
    spec = importlib.util.spec_from_file_location(module, path)
    assert spec is not None and spec.loader is not None
    sys.modules[module] = loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)

EXTREMES = (b"\x00", b"\xff", b"\x7f", b"\x80", b"\x00\x00", b"\xff\xff", b"\x3f\xff", b"\x00\x00\x00\x00",
            b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\xc0\x00\x00\x00")


def corpus(path: Path) -> list[bytes]:
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(bytes.fromhex(line))
    return out


def mutations(rng: random.Random, data: bytes, pool: list[bytes], n: int) -> list[bytes]:
    """``n`` variants of ``data``, drawn with ``rng``; ``pool``: inputs to splice from."""
    out = []
    for _ in range(n):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            how = rng.randrange(6)
            at = rng.randrange(len(b) + 1)
            if how == 0 and b:  # flip a bit
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8)
            elif how == 1:  # cut
                del b[at:]
            elif how == 2:  # grow
                b[at:at] = bytes(rng.getrandbits(8) for _ in range(rng.choice((1, 7, 64, 1500))))
            elif how == 3 and pool:  # splice another input's bytes in
                other = rng.choice(pool)
                start = rng.randrange(len(other) + 1)
                b[at:at + rng.randrange(64)] = other[start:start + rng.randrange(1, 256)]
            elif how == 4:  # a field set to an extreme
                field = rng.choice(EXTREMES)
                b[at:at + len(field)] = field
            else:  # a run of one byte
                b[at:at + rng.randrange(1, 32)] = bytes([rng.getrandbits(8)]) * rng.randrange(1, 32)
        out.append(bytes(b))
    return out
