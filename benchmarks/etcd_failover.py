"""How long the etcd store's next call pauses when the etcd leader dies, beside how long etcd itself takes to
elect another (the floor no client can beat).

    python -m benchmarks.etcd_failover --trials 8

Each trial starts a 3-member cluster on loopback (``erdma_core.testing.etcd``), opens the store with the leader
first in its URL (even trials: the client was talking to the leader) or a follower first (odd trials: its
proposals went through the follower to the leader), makes 20 calls, SIGKILLs the leader and times the next
``set``; a thread meanwhile asks the survivors for their leader every 10 ms, which times the election.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from erdma_core.discovery.etcd import EtcdStore
from erdma_core.testing.etcd import EtcdCluster, missing


def _elected(c: EtcdCluster, dead: int, since: float, out: list[float]) -> None:
    while time.monotonic() - since < 30:
        for i in range(3):
            st = c.status(i, 0.5) if i != dead and c.alive(i) else None
            if st is not None and str(st.get("leader", "0")) not in ("0", c.member_id(dead)):
                out.append(time.monotonic() - since)
                return
        time.sleep(0.01)


def trial(k: int) -> tuple[str, float, float]:
    with EtcdCluster(3, Path(tempfile.mkdtemp(prefix="erdma-failover-"))) as c:
        lead = c.leader()
        c.member_id(lead)  # asked while it lives
        first = lead if k % 2 == 0 else (lead + 1) % 3
        store = EtcdStore([(c.hosts[i], c.client[i]) for i in c.order(first)], "failover", secret=b"bench",
                          quorum_wait=60)
        for n in range(20):
            store.set(f"warm{n}", b"1")
        election: list[float] = []
        c.kill(lead)
        t0 = time.monotonic()
        watcher = threading.Thread(target=_elected, args=(c, lead, t0, election))
        watcher.start()
        store.set("after", b"2")
        pause = time.monotonic() - t0
        watcher.join()
        store.close()
        return ("leader" if first == lead else "follower"), pause, election[0] if election else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=8)
    args = ap.parse_args()
    if missing():
        print(f"skipped: {missing()}")
        return 0
    pauses, elections = [], []
    print("trial  client talked to  next call paused  etcd elected a leader after")
    for k in range(args.trials):
        via, pause, elected = trial(k)
        pauses.append(pause)
        elections.append(elected)
        print(f"{k:5d}  {via:16s}  {pause:14.2f} s  {elected:25.2f} s", flush=True)
    ratio = statistics.median(p / e for p, e in zip(pauses, elections, strict=True))
    print(f"median: paused {statistics.median(pauses):.2f} s, elected {statistics.median(elections):.2f} s; "
          f"max: paused {max(pauses):.2f} s, elected {max(elections):.2f} s; median pause over election {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
