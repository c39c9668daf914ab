"""Three member processes deciding a run of write-once registers over their mesh (``elastic.mesh``), stopped and
killed for real: a SIGSTOPped member does not hold the other two back, the one left alone after a SIGKILL
pauses (it never decides alone), and once the stopped one runs again the two decide on, the stopped one
learning every value decided without it (a member that is done keeps answering until all are). Every key
has one value in every process that printed it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

WORKER = r"""
import os, sys, time
from erdma_core.elastic.mesh import Mesh
from erdma_core.elastic.registers import Registers
from erdma_core.errors import CollectiveTimeoutError

me, where_dir, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
members = ["m0", "m1", "m2"]

def where(m):
    try:
        host, port = open(os.path.join(where_dir, m)).read().split()
    except OSError:
        return None
    return host, int(port)

box = Mesh(b"s" * 32, "job", me, where)
with open(os.path.join(where_dir, me + ".tmp"), "w") as f:
    f.write(f"{box.address[0]} {box.address[1]}")
os.rename(os.path.join(where_dir, me + ".tmp"), os.path.join(where_dir, me))
regs = Registers(me, box.channel(0), retry_s=0.1)
for i in range(count):
    while True:
        try:
            value = regs.decide(f"k/{i}", me.encode(), members, 2.0)
            break
        except CollectiveTimeoutError:
            print("paused", i, flush=True)
    print("decided", i, value.decode(), flush=True)
    time.sleep(0.05)
print("done", flush=True)
while not os.path.exists(os.path.join(where_dir, "stop")):  # answering the others until all are done
    time.sleep(0.05)
regs.close()
box.close()
"""
COUNT = 150


class Member:
    def __init__(self, name: str, where: Path) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, name, str(where), str(COUNT)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.decided: dict[int, str] = {}
        self.paused: list[int] = []
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            parts = line.split()
            if parts[:1] == ["decided"]:
                self.decided[int(parts[1])] = parts[2]
            elif parts[:1] == ["paused"]:
                self.paused.append(int(parts[1]))

    def wait_for(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.decided) < n:
            assert time.monotonic() < deadline, f"{self.name} decided {len(self.decided)} of {n}: {self.lines[-5:]}"
            assert self.proc.poll() is None or len(self.decided) >= n, f"{self.name} exited: {self.lines[-10:]}"
            time.sleep(0.05)


def test_a_stopped_member_holds_nobody_back_the_lone_one_pauses_and_all_agree(tmp_path):
    members = {m: Member(m, tmp_path) for m in ("m0", "m1", "m2")}
    try:
        for m in members.values():
            m.wait_for(10, 60)
        os.kill(members["m2"].proc.pid, signal.SIGSTOP)
        at = len(members["m0"].decided)
        members["m0"].wait_for(at + 30, 60)
        members["m1"].wait_for(at + 30, 60)
        members["m1"].proc.kill()
        members["m1"].proc.wait(10)
        time.sleep(0.5)
        alone = len(members["m0"].decided)
        time.sleep(5.0)
        assert len(members["m0"].decided) <= alone + 1, "m0 went on deciding with 1 of 3 acceptors"
        assert members["m0"].paused, "m0 did not say it paused"
        os.kill(members["m2"].proc.pid, signal.SIGCONT)
        members["m0"].wait_for(COUNT, 120)
        members["m2"].wait_for(COUNT, 120)  # (m0 answers for the keys m2 missed while it was stopped)
        (tmp_path / "stop").touch()
        for m in ("m0", "m2"):
            assert members[m].proc.wait(30) == 0, members[m].lines[-10:]
    finally:
        for m in members.values():
            if m.proc.poll() is None:
                os.kill(m.proc.pid, signal.SIGCONT)
                m.proc.kill()
                m.proc.wait(10)
    for i in range(COUNT):
        values = {m.decided[i] for m in members.values() if i in m.decided}
        assert len(values) == 1, f"key k/{i}: {values}"
    assert members["m1"].decided, "m1 decided nothing before it was killed"
