"""R10 on a real node: two jobs at once keep their data apart; traffic of a job the node never admitted is
refused; 1% of datagrams lost both ways (R6) changes no result."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
from conftest import naca_config
from erdma_naca import header as H

from erdma_core.testing.world import World


def many(pg: Any, base: int) -> list[bool]:
    ok = []
    for i in range(30):
        x = np.full(20_000, base + i + pg.rank(), np.int64)
        pg.allreduce(x)
        ok.append(bool((x == pg.size() * (base + i) + sum(range(pg.size()))).all()))
    assert pg.counters()["allreduce.naca.offloaded"] == 30
    return ok


def test_two_jobs_at_once_stay_apart(start_node: Any, secret_file: Path) -> None:
    node = start_node()
    cfg = naca_config([node], secret_file)
    outcome: dict[str, Any] = {}
    with World(2, config=cfg, timeout=120) as a, World(3, config=cfg, timeout=120) as b:
        t = threading.Thread(target=lambda: outcome.setdefault("a", a.run(many, 1000)))
        t.start()
        outcome["b"] = b.run(many, 5_000_000)
        t.join(120)
    assert all(all(r) for r in outcome["a"]) and len(outcome["a"]) == 2
    assert all(all(r) for r in outcome["b"]) and len(outcome["b"]) == 3
    assert " 0 bad tags" in node.stop()


def test_unknown_job_is_rejected(start_node: Any, secret_file: Path) -> None:
    node = start_node()
    h = H.Header(H.DATA, op=H.ALLREDUCE, dtype=3, redop=1, job=0xDEAD, message=1, total=4, rank=0, size=2, count=4)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.sendto(H.pack(h, b"\0" * 16, b"k" * 32), ("127.0.0.1", node.port))
        answer, _ = s.recvfrom(65536)
    reply = H.peek(answer)
    assert reply.kind == H.REJECT and reply.status == H.UNKNOWN_JOB and reply.job == 0xDEAD
    assert H.verify(answer, H.admission_key(secret_file.read_bytes().strip())) == b""  # no larger than the DATA
    assert len(answer) <= H.LAYOUT.size + 16 + H.TAG_BYTES
    assert "1 for unknown jobs" in node.stop()


def lossy(pg: Any) -> Any:
    r = pg.rank()
    out = []
    for i in range(4):
        x = np.random.default_rng(i * 10 + r).standard_normal(50_000).astype(np.float32)
        pg.allreduce(x)
        out.append(x)
    b = np.arange(30_000, dtype=np.int32) if r == 0 else np.zeros(30_000, np.int32)
    pg.broadcast(b, src=0)
    out.append(b)
    return out, pg.counters()


def test_one_percent_loss_is_recovered(start_node: Any, secret_file: Path) -> None:
    node = start_node("--inject-loss", "0.01")
    with World(4, config=naca_config([node], secret_file, inject_loss=0.01), timeout=120) as world:
        results = world.run(lossy)
    for i in range(4):
        xs = [np.random.default_rng(i * 10 + q).standard_normal(50_000).astype(np.float32) for q in range(4)]
        want = ((xs[0] + xs[1]) + xs[2]) + xs[3]
        assert all(res[0][i].tobytes() == want.tobytes() for res in results)
    assert all(res[0][4].tolist() == list(range(30_000)) for res in results)
    retransmitted = sum(res[1]["naca.retransmissions"] for res in results)
    assert retransmitted > 0 and all(res[1]["naca.failovers"] == 0 for res in results)
    assert " 0 bad tags" in node.stop()
