"""Compression on the collective path, with compressors from an installed plugin (``testcodecs``): every
message of at least ``compression.min_bytes`` is encoded, reductions run on decoded values, lossless codecs
give exact results, lossy ones give every rank the same bits, and error feedback sees stable sites."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import testcodecs

import erdma_core
from erdma_core.compression import Encoded
from erdma_core.engine.codec_set import QUIET_AFTER
from erdma_core.testing import World

HERE = Path(__file__).resolve().parent


@pytest.fixture
def codec_plugin(install_plugin):
    return install_plugin("testcodecs", "testcodecs")


def world(size, codec, **extra):
    """Every collective compressed (``compression.ops = "all"``): the tests below check each of them."""
    return World(size, {"compression.name": codec, "compression.min_bytes": 0, "compression.ops": "all",
                        "timeouts.collective": 60.0, **extra}, timeout=120)


def digest(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def big_values(pg):
    a = np.full(1000, 70000.0, np.float32)
    pg.allreduce(a)
    b = np.full(1000, 0.1, np.float32) * (pg.rank() + 1)
    pg.allreduce(b, algorithm="ring")
    return a[0], b[0], testcodecs.calls(pg)


def test_configured_compressor_is_applied(codec_plugin):
    """Before: encode was never called and 3 x 70000.0 came out exact in float32. fp16 cannot hold 70000."""
    with world(3, "fp16") as w:
        results = w.run(big_values)
    for a0, b0, calls in results:
        assert np.isinf(a0) and calls["fp16"] > 0
        # 0.1, 0.2, 0.3 pass through float16 on the wire: the sum differs from float32's
        assert b0 != np.float32(0.1) + np.float32(0.2) + np.float32(0.3)
        assert abs(b0 - 0.6) < 1e-3
    assert len({float(b0) for _, b0, _ in results}) == 1


def below_threshold(pg):
    a = np.full(100, 70000.0, np.float32)  # 400 bytes: below min_bytes
    pg.allreduce(a)
    return float(a[0]), testcodecs.calls(pg).get("fp16", 0)


def test_messages_below_min_bytes_go_raw(codec_plugin):
    with World(3, {"compression.name": "fp16", "compression.min_bytes": 4096}) as w:
        assert w.run(below_threshold) == [(210000.0, 0)] * 3


def counted(pg):
    import logging

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("erdma.compression").addHandler(handler)
    logging.getLogger("erdma.compression").setLevel(logging.INFO)
    pg.allreduce(np.ones(100, np.float32))  # 400 bytes: under min_bytes, raw
    before = {k: v for k, v in pg.counters().items() if k.startswith("compression.")}
    pg.allreduce(np.ones(30000, np.float32), algorithm="ring")  # 40,000-byte messages: encoded
    return before, pg.counters(), [line for line in seen if line.startswith(f"rank {pg.rank()}: ")]


def test_counters_and_a_log_line_say_what_the_compressor_did(codec_plugin):
    """Before: pg.counters() was {} with a compressor configured, and nothing said that it ever applied."""
    with World(3, {"compression.name": "fp16", "compression.min_bytes": 4096}) as w:
        results = w.run(counted)
    for rank, (before, after, seen) in enumerate(results):
        assert set(before) == {"compression.fp16.small.messages", "compression.fp16.small.raw_bytes"}, before
        assert before["compression.fp16.small.messages"] >= 1
        assert 0 < before["compression.fp16.small.raw_bytes"] <= 400 * before["compression.fp16.small.messages"]
        assert after["compression.fp16.encoded.messages"] >= 2
        assert after["compression.fp16.encoded.raw_bytes"] == 40000 * after["compression.fp16.encoded.messages"]
        assert after["compression.fp16.encoded.wire_bytes"] == after["compression.fp16.encoded.raw_bytes"] // 2
        assert seen == [f"rank {rank}: compression 'fp16' applies: a message of 40000 bytes went out as 20000"], seen


def never_compressed(pg):
    import logging

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(f"{record.levelname} {record.getMessage()}")  # type: ignore[method-assign]
    logging.getLogger("erdma.compression").addHandler(handler)
    for _ in range(QUIET_AFTER + 5):
        pg.allreduce(np.ones(100, np.float32))  # 400 bytes: under min_bytes, raw
    return [line for line in seen if f"rank {pg.rank()}: " in line]


def test_a_compressor_that_never_applies_is_warned_about_once(codec_plugin):
    """Before: int8 configured with the default min_bytes never applied to a small DDP model, silently."""
    with World(2, {"compression.name": "fp16", "compression.min_bytes": 4096, "compression.ops": "allreduce"}) as w:
        results = w.run(never_compressed)
    for rank, seen in enumerate(results):
        assert len(seen) == 1, seen
        assert seen[0].startswith(f"WARNING rank {rank}: compression 'fp16' has encoded nothing in the first "
                                  f"{QUIET_AFTER} collectives: "), seen
        assert "messages under compression.min_bytes (4096 bytes)" in seen[0], seen
        assert "Lower compression.min_bytes or widen compression.ops" in seen[0], seen


def by_role(pg):
    """70000 does not fit float16: a collective that was compressed with fp16 says so with an inf."""
    out = {}
    for op in ("allreduce", "broadcast", "allgather", "reduce_scatter"):
        a = np.full(3000, 70000.0, np.float32)
        if op == "allreduce":
            pg.allreduce(a)
        elif op == "broadcast":
            pg.broadcast(a, src=0)
        elif op == "allgather":
            g = np.empty(3000 * pg.size(), np.float32)
            pg.allgather(g, a)
            a = g
        else:
            r = np.empty(1000, np.float32)
            pg.reduce_scatter(r, a)
            a = r
        out[op] = bool(np.isinf(a).any())
    return out


@pytest.mark.parametrize("ops, compressed", [
    ("auto", {"allreduce", "reduce_scatter"}),  # a lossy codec: the reductions (gradients), not parameters
    ("all", {"allreduce", "broadcast", "allgather", "reduce_scatter"}),
    ("broadcast, allreduce", {"allreduce", "broadcast"}),
])
def test_compression_ops_choose_the_collectives(codec_plugin, ops, compressed):
    with World(3, {"compression.name": "fp16", "compression.min_bytes": 0, "compression.ops": ops}) as w:
        results = w.run(by_role)
    for result in results:
        assert {op for op, inf in result.items() if inf} == compressed


def test_compression_ops_refuses_what_is_not_a_collective(codec_plugin, tmp_path):
    from erdma_core.engine.codec_set import parse_ops
    from erdma_core.errors import ConfigError

    assert parse_ops("auto", lossy=False) is None and parse_ops("all", lossy=True) is None
    with pytest.raises(ConfigError, match=r"'compression\.ops': invalid value 'allreduce,bcast' \('bcast' is not a "
                                          r"collective\); valid: auto, all, or a comma-separated list of allreduce, "
                                          r"broadcast"):
        parse_ops("allreduce,bcast", lossy=True)
    with pytest.raises(ConfigError, match=r"'compression\.ops'"):
        erdma_core.init({"compression.ops": "nothing"}, rank=0, world_size=1, init_method=f"file://{tmp_path}")


def every_collective(pg, algorithms):
    p, r = pg.size(), pg.rank()
    rng = np.random.default_rng([r, 7])
    mine = rng.standard_normal(6007).astype(np.float32)
    inputs = [np.random.default_rng([q, 7]).standard_normal(6007).astype(np.float32) for q in range(p)]
    out = {}
    for algo in algorithms:
        a = mine.copy()
        pg.allreduce(a, algorithm=algo)
        out[f"allreduce/{algo}"] = a
    a = np.zeros(6007 * p, np.float32)
    pg.allgather(a, mine)
    out["allgather"] = a
    b = mine.copy()
    pg.broadcast(b, src=p - 1)
    out["broadcast"] = b
    rs = np.zeros(2000, np.float32)
    pg.reduce_scatter(rs, np.concatenate([mine[:2000]] * p))
    out["reduce_scatter"] = rs
    ints = np.arange(5000, dtype=np.int64) * (r + 1)
    pg.allreduce(ints)
    exact = {"allgather": np.concatenate(inputs), "broadcast": inputs[p - 1],
             "int64 allreduce": np.arange(5000) * (p * (p + 1) // 2), "int64 got": ints}
    return {k: digest(v) for k, v in out.items()}, {k: v for k, v in out.items()}, exact, testcodecs.calls(pg)


ALLREDUCE = ["ring", "halving_doubling", "recursive_doubling", "tree", "parameter_server"]


def test_lossless_codec_gives_exact_results(codec_plugin):
    """Every result bit for bit what the same collectives give uncompressed."""
    with world(3, "none") as w:
        plain = w.run(every_collective, ALLREDUCE)
    with world(3, "zlib") as w:
        results = w.run(every_collective, ALLREDUCE)
    for rank, (digests, values, exact, calls) in enumerate(results):
        assert calls["zlib"] > 0
        assert digests == plain[rank][0]
        assert np.array_equal(values["allgather"], exact["allgather"])
        assert np.array_equal(values["broadcast"], exact["broadcast"])
        assert np.array_equal(exact["int64 got"], exact["int64 allreduce"])


@pytest.mark.parametrize("size", [2, 3, 4])
def test_lossy_codec_leaves_every_rank_with_the_same_bits(codec_plugin, size):
    """int8 absmax is not idempotent: re-encoding decoded values changes them. Ranks agree only because
    received elements are forwarded as they came and senders keep what their peers decode. Small chunks
    make several messages per slice, and halving-doubling's unions of slices go raw."""
    with world(size, "int8", **{"collectives.chunk_bytes": 4096}) as w:
        results = w.run(every_collective, ALLREDUCE)
    for digests, _, exact, calls in results:
        assert calls["int8"] > 0
        replicated = {k: v for k, v in digests.items() if k != "reduce_scatter"}
        assert replicated == {k: v for k, v in results[0][0].items() if k != "reduce_scatter"}, "ranks disagree"
        assert np.array_equal(exact["int64 got"], exact["int64 allreduce"])  # int64: the codec passes
    values, exact = results[0][1], results[0][2]
    truth = sum(np.random.default_rng([q, 7]).standard_normal(6007).astype(np.float64) for q in range(size))
    for algo in ALLREDUCE:
        err = np.abs(values[f"allreduce/{algo}"] - truth).max()
        assert 0 < err < 0.2 * size, (algo, err)  # lossy, but close
    assert np.abs(values["broadcast"] - exact["broadcast"]).max() < 0.05


def pipelined(pg, algorithms):
    return every_collective(pg, algorithms), testcodecs.threads(pg)


@pytest.mark.parametrize("codec", ["int8", "zlib"])
def test_pipelined_encoding_runs_ahead_and_changes_no_bit(codec_plugin, codec):
    """compression.pipeline: a step of several messages encodes the next one on the helper thread while it
    sends the current one; every result is bit for bit what encoding each message in turn gives."""
    runs = {}
    for pipeline in (False, True):
        with world(3, codec, **{"collectives.chunk_bytes": 4096, "compression.pipeline": pipeline}) as w:
            runs[pipeline] = w.run(pipelined, ALLREDUCE)
    for rank in range(3):
        (digests, _, _, calls), threads = runs[True][rank]
        (plain, _, _, plain_calls), plain_threads = runs[False][rank]
        assert digests == plain and calls == plain_calls
        assert set(plain_threads) == {"MainThread"}
        assert threads.get("erdma-encode_0", 0) > 0


def failing(pg):
    testcodecs.FAILS_AT = 3 if pg.rank() == 0 else 1 << 30
    a = np.ones(20_000, np.float32)
    pg.allreduce(a, algorithm="ring")
    return a


@pytest.mark.parametrize("pipeline", [True, False])
def test_an_encode_that_fails_fails_the_collective_everywhere(codec_plugin, pipeline):
    """Rank 0's third encode raises (pipelined: on the helper thread, since a ring step sends several
    messages): rank 0 raises that error, and rank 1 learns at once which rank failed and why, instead of
    waiting for its timeout."""
    with world(2, "fails", **{"collectives.chunk_bytes": 4096, "compression.pipeline": pipeline}) as w:
        errors = w.outcomes(failing)
    assert isinstance(errors[0], RuntimeError) and str(errors[0]) == "encode number 3 fails"
    assert isinstance(errors[1], erdma_core.errors.AbortedError)
    assert re.search(r"rank 0: allreduce \(group 0, seq \d+\) failed there: RuntimeError: encode number 3 fails",
                     str(errors[1])), errors[1]


def stalling(pg):
    testcodecs.SLOW_AT, testcodecs.SLOW_S = (3, 3.0) if pg.rank() == 0 else (1 << 30, 0.0)
    if pg.rank() == 1:  # rank 1 would otherwise hit its own 1 s deadline first when it started a moment earlier
        pg.rt.timeout = 10.0
    a = np.ones(20_000, np.float32)
    pg.allreduce(a, algorithm="ring")
    return a


def test_an_encode_that_outlasts_the_timeout_on_the_helper_thread_fails_in_time(codec_plugin):
    """Rank 0's third encode, on the helper thread, takes 3 s against a 1 s collective timeout: rank 0 stops
    waiting at its deadline and says what it was doing; rank 1 (10 s) learns that rank 0 gave up."""
    with world(2, "slow", **{"collectives.chunk_bytes": 4096, "compression.pipeline": True,
                             "timeouts.collective": 1.0}) as w:
        errors = w.outcomes(stalling)
    assert isinstance(errors[0], erdma_core.errors.CollectiveTimeoutError), errors[0]
    assert re.search(r"rank 0: allreduce \(group 0, seq \d+\) hit its timeout of 1\.0s encoding a message for "
                     r"rank 1", str(errors[0])), errors[0]
    assert isinstance(errors[1], erdma_core.errors.CollectiveError), errors[1]
    assert re.search(r"failed on rank 1: rank 1: rank 0 aborted the job: rank 0: allreduce .* encoding a message "
                     r"for rank 1", str(errors[1])), errors[1]


def repeated(pg, steps):
    x = np.linspace(-1, 1, 4096).astype(np.float32) * (pg.rank() + 1) / 3
    buf = np.empty_like(x)
    results = []
    for _ in range(steps):
        buf[:] = x
        pg.allreduce(buf, algorithm="ring")
        results.append(buf.copy())
    sites = {s for s in testcodecs.SITES if s is not None}
    return np.mean(results, axis=0), results[0], len(sites), len(testcodecs.SITES)


def test_error_feedback_sites_are_stable_and_residuals_cancel(codec_plugin):
    """The same buffer reduced again gives the same sites (so residuals carry over), and with the residual
    added each step, the average over steps comes much closer to the exact sum than one step does."""
    with world(2, "int8") as w:
        results = w.run(repeated, 40)
    truth = np.linspace(-1, 1, 4096) * (1 + 2) / 3
    mean, first, distinct, total = results[0]
    assert total == 40 * distinct  # every step encodes at the same sites
    assert np.abs(mean - truth).max() < np.abs(first - truth).max() / 4


def test_receivers_decode_codecs_they_were_not_configured_with(codec_plugin, tmp_path):
    """Rank 0 sends zlib, rank 1 sends raw; each decodes the other's messages by the id in the frame. A rank
    without the sender's codec installed fails with an error naming the codec id (and its peer learns why)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent('''
        import os, sys, numpy as np, erdma_core
        rank = int(os.environ["RANK"])
        codec = sys.argv[1] if rank == 0 else "none"
        pg = erdma_core.init({"compression.name": codec, "compression.min_bytes": 0, "timeouts.collective": 30})
        a = np.arange(50000, dtype=np.float64) * (rank + 1)
        try:
            pg.allreduce(a)
            print("ok", bool((a == np.arange(50000) * 3).all()))
        except Exception as exc:
            print(type(exc).__name__, exc)
        pg.destroy()
    '''))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")}
    env["PYTHONPATH"] = os.pathsep.join([str(codec_plugin), str(HERE)])

    def run(codec, **extra):
        r = subprocess.run([sys.executable, "-m", "erdma_core.cli", "run", "-n", "2", "--", sys.executable,
                            str(script), codec], capture_output=True, text=True, timeout=120, env=env | extra)
        return sorted(r.stdout.splitlines())

    assert run("zlib", ERDMA_PLUGINS="testcodecs") == ["[rank 0] ok True", "[rank 1] ok True"]
    # rank 1 cannot load testcodecs at all: its config would not accept "zlib", but it need not; rank 0's
    # frames name codec zlib, which rank 1 does not have
    env1 = env | {"ERDMA_PLUGINS": "testcodecs"}
    r = subprocess.run([sys.executable, "-m", "erdma_core.cli", "run", "-n", "2", "--", sys.executable, "-c",
                        textwrap.dedent('''
        import os, numpy as np, erdma_core
        rank = int(os.environ["RANK"])
        if rank == 1:
            os.environ["ERDMA_PLUGINS"] = ""  # an empty allow list: no external plugin
        pg = erdma_core.init({"compression.name": "zlib" if rank == 0 else "none", "compression.min_bytes": 0,
                              "timeouts.collective": 30})
        try:
            pg.allreduce(np.ones(50000))
            print("no error")
        except Exception as exc:
            print(type(exc).__name__, exc)
    ''')], capture_output=True, text=True, timeout=120, env=env1)
    lines = sorted(r.stdout.splitlines())
    assert lines[1].startswith("[rank 1] ProtocolError") and "encoded by codec 0x" in lines[1] \
        and "which no compressor installed here has" in lines[1], lines
    assert lines[0].startswith("[rank 0] AbortedError") and "rank 1 aborted the job" in lines[0], lines


class _Slow:
    """A codec whose encode takes a known time and halves the bytes."""

    name, lossy = "slow", False

    def encode(self, data, dtype, site):
        import time

        time.sleep(0.01)
        return Encoded(data.view(np.uint8)[: data.nbytes // 2].copy())


def test_policy_auto_encodes_only_where_the_link_is_slower_than_the_codec():
    from erdma_core.engine.codec_set import PROBE_EVERY, Codecs

    rates = {1: 1e3, 2: 1e12, 3: None}  # bytes/s: a slow link, a fast one, one not measured yet
    codecs = Codecs(_Slow(), 0, lambda cid: None, link_rate=rates.get)
    assert codecs.worth(2, 1 << 20)  # nothing measured: encode (and measure)
    codecs.encode(np.zeros(1 << 18, np.float32), "float32", None)
    assert codecs.ratio == 0.5 and codecs.encode_s > 0.01 / (1 << 20)
    decisions = [codecs.worth(2, 1 << 20) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2 and decisions[PROBE_EVERY - 1]  # only the probes
    assert all(codecs.worth(1, 1 << 20) for _ in range(10))  # 0.5 MiB saved at 1 kB/s: worth 10 ms and more
    assert codecs.worth(3, 1 << 20)
    always = Codecs(_Slow(), 0, lambda cid: None)
    always.encode(np.zeros(1 << 18, np.float32), "float32", None)
    assert all(always.worth(2, 1 << 20) for _ in range(10))


def test_the_codecs_decide_which_messages_go_raw_and_count_why():
    """``sends_raw``: under ``min_bytes`` (small), or not worth it on the link (skipped); the rest is offered."""
    from erdma_core.engine.codec_set import Codecs

    codecs = Codecs(_Slow(), 4096, lambda cid: None, link_rate={1: 1e12}.get)
    assert codecs.sends_raw(1, 4095) and not codecs.sends_raw(1, 1 << 20)  # nothing measured yet: offered
    codecs.encode(np.zeros(1 << 18, np.float32), "float32", None)
    assert codecs.sends_raw(1, 1 << 20)  # 0.5 MiB saved on a link of 1 TB/s is not worth 10 ms
    assert {k: v for k, v in codecs.stats().items() if not k.startswith("encoded")} == {
        "small.messages": 1, "small.raw_bytes": 4095, "skipped.messages": 1, "skipped.raw_bytes": 1 << 20}


def fast_link(pg):
    a = np.full(3000, 70000.0, np.float32)
    results = []
    for _ in range(5):
        a[:] = 70000.0
        pg.allreduce(a)
        results.append(float(a[0]))
    peer = pg.ranks[1 - pg.rank()]
    return results, pg.transport.link_rate(peer), testcodecs.calls(pg)["fp16"]


@pytest.mark.parametrize("local", [True, False])
def test_policy_auto_stops_encoding_on_a_fast_link(codec_plugin, local):
    """fp16 cannot hold 70000: the first allreduce is encoded (inf), then the policy finds the link (a Unix
    socket, or loopback TCP at GB/s) faster than the codec and sends raw (exact)."""
    with World(2, {"compression.name": "fp16", "compression.min_bytes": 0, "compression.policy": "auto",
                   "transport.tcp.local_sockets": local}) as w:
        results = w.run(fast_link)
    for values, rate, calls in results:
        assert np.isinf(values[0]) and values[1:] == [140000.0] * 4
        assert rate == np.inf if local else 1e6 < rate < np.inf
        assert calls == 1
