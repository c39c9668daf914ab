"""Runs inside the test guest (``tests/test_guest.py`` boots it), on SoftRoCE: two RC queue pairs on one rxe
device (rxe loops packets to its own address back through the full RoCEv2 path) exchange a SEND and an
RDMA WRITE with immediate, byte for byte; a bad transition is named; every QP, CQ, MR and PD is released."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the plugin's folder, shared into the guest

from erdma_verbs.rc import Endpoint, VerbsError
from pyverbs import enums as e

DEVICE = "rxe0"


def resources() -> dict[str, int]:
    """``rdma resource`` counts of the rxe device: qp, cq, mr, pd."""
    out = subprocess.run(["rdma", "resource", "show"], capture_output=True, text=True, check=True).stdout
    counts: dict[str, int] = {}
    for line in out.splitlines():
        words = line.split()
        if words and words[1].startswith(DEVICE):
            for key, value in zip(words[2::2], words[3::2], strict=False):
                counts[key] = int(value)
    return counts


@pytest.fixture
def pair():
    before = resources()
    a, b = Endpoint(DEVICE), Endpoint(DEVICE)
    a.connect(b.address())
    b.connect(a.address())
    yield a, b
    a.close()
    b.close()
    assert resources() == before  # nothing leaked


def test_send_and_receive_byte_for_byte(pair):
    a, b = pair
    data = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    got = np.zeros_like(data)
    b.post_recv(b.register(got), got, wr_id=7)
    a.send(a.register(data), data, wr_id=8)
    deadline = time.monotonic() + 30
    assert [wc.wr_id for wc in a.poll(1, deadline)] == [8]
    (wc,) = b.poll(1, deadline)
    assert wc.wr_id == 7 and wc.byte_len == data.nbytes
    assert np.array_equal(got, data)


def test_rdma_write_with_immediate_lands_in_the_peers_buffer(pair):
    a, b = pair
    data = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    target = np.zeros_like(data)
    mr = b.register(target)
    empty = np.zeros(1, np.uint8)  # the immediate's receive needs a work request with one SGE
    b.post_recv(b.register(empty), empty, wr_id=1)
    a.write_imm(a.register(data), data, target.ctypes.data, mr.rkey, imm=0x1234, wr_id=2)
    deadline = time.monotonic() + 60
    a.poll(1, deadline)
    (wc,) = b.poll(1, deadline)
    assert wc.imm_data == 0x1234 and wc.wc_flags & e.IBV_WC_WITH_IMM
    assert np.array_equal(target, data)


def test_a_transition_that_fails_is_named(pair):
    a, b = pair
    with pytest.raises(VerbsError, match=r"queue pair \d+: the move to INIT failed"):
        a.connect(b.address())  # already in RTS: RTS -> INIT is not a transition verbs allow
