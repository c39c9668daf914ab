"""``alltoall`` called again on the same arrays skips turning them into buffers (``api/recent.py``), and
still sees every change that matters: new contents, another array, an array reshaped, retyped or made
read-only in place, an array gone. Results are compared with numpy; errors by type and message."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from erdma_core.api.recent import Recent

CONFIG = {"timeouts.collective": 60.0}


def test_recent_matches_the_same_arrays_unchanged_only() -> None:
    out, inp = np.zeros((4, 2), np.int32), np.ones((4, 2), np.int32)
    recent = Recent()
    recent.put(out, inp, ("key",), "value")
    assert recent.get(out, inp, ("key",)) == "value"
    assert recent.get(out, inp, ("other key",)) is None
    assert recent.get(out.copy(), inp, ("key",)) is None  # another array, equal
    assert recent.get(inp, out, ("key",)) is None
    out.shape = (2, 4)
    assert recent.get(out, inp, ("key",)) is None
    out.shape = (4, 2)
    assert recent.get(out, inp, ("key",)) == "value"
    out.flags.writeable = False
    assert recent.get(out, inp, ("key",)) is None
    out.flags.writeable = True
    inp.dtype = np.float32  # (in place: same bytes read as another type)
    assert recent.get(out, inp, ("key",)) is None


def test_recent_keeps_no_array_alive_and_remembers_only_numpy_arrays() -> None:
    out, inp = np.zeros(8, np.int32), np.ones(8, np.int32)
    recent = Recent()
    recent.put(out, inp, None, "value")
    del out
    gc.collect()
    assert recent.get(np.zeros(8, np.int32), inp, None) is None  # (may reuse the freed array's address)
    view = memoryview(bytearray(32))
    recent.put(view, inp, None, "value")
    assert recent.get(view, inp, None) is None


def repeated(pg):
    """Ten rounds on the same arrays with new contents, then an output of its own, then the same output
    made read-only, and an input reshaped in place so that the split sizes no longer fit it."""
    p, r = pg.size(), pg.rank()
    out, inp = np.zeros((p, 5), np.int64), np.zeros((p, 5), np.int64)
    bad = []
    for k in range(10):
        inp[:] = np.arange(p * 5).reshape(p, 5) + 1000 * r + 100_000 * k
        pg.alltoall(out, inp, algorithm="pairwise")
        want = np.stack([np.arange(5) + 5 * r + 1000 * q + 100_000 * k for q in range(p)])
        if not np.array_equal(out, want):
            bad.append(k)
    other = np.full((p, 5), -1, np.int64)
    pg.alltoall(other, inp, algorithm="pairwise")
    errors = []
    out.flags.writeable = False
    try:
        pg.alltoall(out, inp, algorithm="pairwise")
    except ValueError as exc:
        errors.append(str(exc))
    out.flags.writeable = True
    sizes = [1] * p
    for _ in range(2):
        pg.alltoall(out, inp, output_split_sizes=sizes, input_split_sizes=sizes)
    inp.shape = (p * 5,)  # one row for each rank no longer sums to its dim 0
    try:
        pg.alltoall(out, inp, output_split_sizes=sizes, input_split_sizes=sizes)
    except ValueError as exc:
        errors.append(str(exc))
    return bad, bool(np.array_equal(other, want)), errors


@pytest.mark.parametrize("size", [2, 3])
def test_alltoall_on_the_same_arrays_again_sees_every_change(erdma_world, size: int) -> None:
    results = erdma_world(size, CONFIG).run(repeated)
    ones = [1] * size
    assert results == [([], True, [
        "output: the buffer is read-only, but this op writes its result into it",
        f"alltoall: input_split_sizes={ones} must be {size} non-negative sizes summing to dim 0 ({size * 5})",
    ])] * size
