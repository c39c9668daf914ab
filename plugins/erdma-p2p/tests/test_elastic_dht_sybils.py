"""An elastic job on ``dht://`` alone among 20 hostile DHT nodes (``test_dht_attacks``' kinds): 10 Sybils that
take every record and keep nothing, and 10 that answer every read with a forged record and overwrite every key
they see, again and again. The job starts, steps, and admits a newcomer; every step's hash is one across the
peers. How long the newcomer took from its start to its first step with the members is printed beside the
same admission with no hostile node, measured in the same test (not asserted: it varies on a busy machine)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

from erdma_p2p.dht_store import DhtStore
from test_dht_attacks import forgers, sybils
from test_elastic_dht import ENV, PEER, SECRET, SECTION

from erdma_core.elastic import found
from erdma_core.testing.elastic import ElasticJob, python, steps, until

STEP = re.compile(r"step (\d+) n (\d+) .* hash (\w+) ")


def _admission(url: str, addrs: list[tuple[str, int]], job: str, tmp: Path) -> float:
    """A 3-peer job on ``url``/``job``, founded here; a newcomer started after 3 steps. Seconds from its start
    to its first step with the members; asserts one hash per step across the four."""
    tmp.mkdir()
    creator = DhtStore(addrs, job, SECRET.encode(), timeout=10.0, section=SECTION)
    env = {**ENV, "STOP_FILE": str(tmp / "stop")}
    env.pop("ERDMA_DISCOVERY_DHT_BIND_ADDRESS")  # (every address: the hostile nodes sit on 127.0.0.2)
    try:
        with ElasticJob(python(*PEER), tmp, min_peers=3, store_url=f"{url}/{job}", secret=SECRET, env=env) as j:
            threading.Thread(target=found, args=(creator, "default", 3, 120.0), daemon=True).start()
            members = [j.start() for _ in range(3)]
            until(lambda: all(len(steps(p)) >= 3 for p in members), "3 steps of the three", 180)
            newcomer, started = j.start(), time.monotonic()
            until(lambda: any(" n 4 " in line for line in steps(newcomer)), "the newcomer stepping", 120)
            took = time.monotonic() - started
            (tmp / "stop").touch()
            assert [p.wait(60) for p in (*members, newcomer)] == [0, 0, 0, 0], newcomer.lines[-10:]
            hashes: dict[int, set[str]] = {}
            for p in (*members, newcomer):
                for m in filter(None, map(STEP.search, p.lines)):
                    hashes.setdefault(int(m.group(1)), set()).add(m.group(3))
            assert hashes and all(len(h) == 1 for h in hashes.values())
            return took
    finally:
        creator.close()


def test_twenty_hostile_dht_nodes_cannot_change_or_stop_an_elastic_job(honest: Any, tmp_path: Path) -> None:
    url, addrs = honest
    calm = _admission(url, addrs, "calm", tmp_path / "calm")
    keepers = sybils(addrs, 10)
    try:
        with forgers(addrs, 10, pause=0.2) as seen:
            took = _admission(url, addrs, "hostile", tmp_path / "hostile")
    finally:
        for node in keepers:
            node.stop()
    assert seen  # the forgers did see the job's keys
    print(f"a newcomer's admission: {took:.1f}s among 20 hostile DHT nodes, {calm:.1f}s with none")
