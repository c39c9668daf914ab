"""A stranger who reaches a rank's UDP port cannot run it out of memory: genuine QUIC Initials (no
certificate) from 64 source ports at 250 a second against a running 2-rank job, whose rank 1 starts while the
flood is under way. Rank 0's memory grows by at most 20 MB, no more connection objects stay alive than its
table of handshakes under way (``MAX_PENDING``) and the link to rank 1, every allreduce result is right, and
rank 1 joins. On each engine: Initials for another ALPN (refused at the first flight, as the listener's table
fills: answered with stateless Retry packets), and Initials for the job's ALPN whose sender follows each Retry
with its token (a stranger with a real address) and then goes silent mid-handshake, filling the table.

Each rank is a process of its own (``flood_job.py``), as is the flood (``initial_flood.py``); a process's
stderr goes to a file, so that nothing it says can block it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from erdma_quic.mesh import MAX_PENDING, PER_SOURCE
from erdma_quic.ngtcp2.connection import loaded
from erdma_quic.streams import ALPNS

HERE = Path(__file__).parent
RATE = 250.0  # Initials a second
GROWTH = 20 << 20  # bytes rank 0's memory may grow by


def _free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, env: dict[str, str], stop: Path, quic_port: int = 0) -> subprocess.Popen[str]:
    with open(stop.with_name(f"rank{rank}.err"), "w") as err:
        return subprocess.Popen([sys.executable, str(HERE / "flood_job.py"), str(stop)], text=True,
                                stdout=subprocess.PIPE, stderr=err,
                                env=env | {"RANK": str(rank), "ERDMA_TRANSPORT_QUIC_PORT": str(quic_port)})


@pytest.mark.parametrize(("engine", "count", "follow_retry"), [("ngtcp2", 10000, False), ("ngtcp2", 2000, True),
                                                              ("aioquic", 1500, False), ("aioquic", 600, True)],
                         ids=["ngtcp2-initials", "ngtcp2-retry-followed", "aioquic-initials", "aioquic-retry-followed"])
def test_a_flood_of_initials_leaves_no_state_behind_and_a_rank_still_joins(tmp_path, engine, count, follow_retry):
    if engine == "ngtcp2" and loaded() is None:
        pytest.skip("the compiled engine is not built here")
    port, store = _free_port(socket.SOCK_DGRAM), _free_port(socket.SOCK_STREAM)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store),
           "ERDMA_TRANSPORT": "quic", "ERDMA_SECRET": "flood-test", "ERDMA_TIMEOUT": "120",
           "ERDMA_TIMEOUTS_CONNECT": "120", "ERDMA_TRANSPORT_QUIC_BIND_ADDRESS": "127.0.0.1",
           "ERDMA_TRANSPORT_QUIC_ENGINE": engine}
    stop = tmp_path / "stop"
    ranks = [_rank(0, env, stop, port)]
    time.sleep(1.0)  # rank 0 listens (it waits for rank 1 in its set-up)
    flood = subprocess.Popen([sys.executable, str(HERE / "initial_flood.py"), f"127.0.0.1:{port}", "--count",
                              str(count), "--rate", str(RATE), "--ports", "64",
                              *(["--follow-retry", "--alpn", ALPNS[engine]] if follow_retry else [])],
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(3.0)  # the flood is under way: now rank 1 starts and must join
        ranks.append(_rank(1, env, stop))
        flooded, ferr = flood.communicate(timeout=count / RATE * 3 + 60)
        assert flood.returncode == 0, ferr
        stop.touch()
        outs = [p.communicate(timeout=120)[0] for p in ranks]
    finally:
        for p in [flood, *ranks]:
            p.kill()
    for rank, p in enumerate(ranks):
        assert p.returncode == 0, (tmp_path / f"rank{rank}.err").read_text()[-3000:]
    res = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    stats = json.loads(flooded)
    assert stats["sent"] == count, stats
    if follow_retry:
        assert stats["resent"] > 0, stats  # the listener answered with Retry packets, and they were followed
    assert [r["wrong"] for r in res] == [0, 0] and res[0]["iters"] > 0, res
    r0 = res[0]
    assert r0["rss_max"] - r0["rss_first"] <= GROWTH, json.dumps(r0)
    # no more than the table of handshakes under way, and the connection to rank 1 (aioquic's connections of
    # strangers dropped mid-handshake are freed by the cyclic collector: their parts refer to each other)
    kinds = ["session", "engine", "ngtcp2"] if engine == "ngtcp2" else ["session"]
    assert max(r0["objects_max"][k] for k in kinds) <= MAX_PENDING + 1, json.dumps(r0)
    assert max(r0["objects_end"].values()) <= r0["pending"] + 1 <= PER_SOURCE + 1, json.dumps(r0)
    if not follow_retry:  # each was refused at its first flight (another ALPN) or answered with a Retry
        assert r0["objects_end"]["session"] == 1, json.dumps(r0)
