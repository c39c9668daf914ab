"""A network partition of the job's etcd cluster never lets the two sides commit different values: each member
in a network namespace of its own (benchmarks/netlab), the leader cut off from the other two (everything but
its loopback dropped both ways), a client beside it and a client on the majority's side both try to be the
first to set the same key, as two halves of an elastic job would race to commit the next epoch. The cut-off
side's call is refused after quorum_wait (nothing committed: the isolated leader appended its proposal but
could not commit it, and lost it to the new leader's log), the majority's commits; after the cut heals, the
cut-off client's same call finds the majority's value."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

from benchmarks.netlab.topology import Lab, LinkSpec  # noqa: E402
from erdma_core.discovery.etcd import EtcdStore  # noqa: E402
from erdma_core.testing import etcd  # noqa: E402

SECRET = b"partition-test"
CLIENT = """
import json, sys
from erdma_core.discovery.etcd import EtcdStore
from erdma_core.errors import ErdmaError
endpoints = [(h, int(p)) for h, p in (e.rsplit(":", 1) for e in sys.argv[1].split(","))]
store = EtcdStore(endpoints, "part", secret=b"partition-test", quorum_wait=float(sys.argv[2]))
try:
    print(json.dumps(["ok", store.compare_set("epoch", b"", sys.argv[3].encode()).decode()]))
except ErdmaError as exc:
    print(json.dumps([type(exc).__name__, str(exc)]))
"""
CUT = """table inet erdmacut {
  chain in { type filter hook input priority -10; policy accept; iifname "lo" accept; drop; }
  chain out { type filter hook output priority -10; policy accept; oifname "lo" accept; drop; }
}"""


def _client(lab: Lab, i: int, endpoints: list[str], quorum_wait: float, value: str) -> subprocess.Popen[str]:
    """A store client in member ``i``'s namespace, trying to be first to set "epoch" to ``value``."""
    return lab.popen(i, [sys.executable, "-c", CLIENT, ",".join(endpoints), str(quorum_wait), value],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])


@pytest.mark.skipif(etcd.missing() is not None, reason=str(etcd.missing()))
def test_the_cut_off_side_commits_nothing_and_finds_the_majoritys_value_after(tmp_path: Path) -> None:
    with Lab(3, LinkSpec(), host_port=True) as lab, \
            etcd.EtcdCluster(3, tmp_path, hosts=[lab.addr(i) for i in range(3)], command=lab.command) as c:
        lead = c.leader()
        others = [i for i in range(3) if i != lead]
        majority = EtcdStore([(lab.addr(i), c.client[i]) for i in [*others, lead]], "part", secret=SECRET,
                             quorum_wait=60.0)
        majority.set("warm", b"1")
        subprocess.run(lab.command(lead, ["nft", "-f", "-"]), input=CUT, text=True, check=True, timeout=30)
        cut_off = _client(lab, lead, [c.endpoints[lead], *(c.endpoints[i] for i in others)], 6.0, "minority")
        time.sleep(0.5)  # its proposal reaches the isolated leader's log first
        won: list[bytes] = []
        t = threading.Thread(target=lambda: won.append(majority.compare_set("epoch", b"", b"majority")))
        t.start()
        out, err = cut_off.communicate(timeout=120)
        t.join(120)
        kind, said = json.loads(out)
        assert kind == "ErdmaError" and "no etcd member served the store within 6.0s" in said, (out, err)
        assert "for a majority of them" in err, err  # it said it waits
        assert won == [b"majority"] and majority.get("epoch", 5.0) == b"majority"

        subprocess.run(lab.command(lead, ["nft", "delete", "table", "inet", "erdmacut"]), check=True, timeout=30)
        again = _client(lab, lead, [c.endpoints[lead], *(c.endpoints[i] for i in others)], 60.0, "minority")
        out, err = again.communicate(timeout=120)
        assert json.loads(out) == ["ok", "majority"], (out, err)
        assert majority.compare_set("epoch", b"", b"late") == b"majority"  # it stands: "" no longer matches
        majority.close()
