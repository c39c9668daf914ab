"""What a job leaves on the host: nothing once it closes (memif sockets removed, DPDK's run-time folder gone
from the start); a killed rank's sockets are removed by the next rank that starts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from erdma_dpdk import eal

from erdma_core.testing.world import RankFailure

from .conftest import needs_dpdk


def _pid(pg):
    pg.allreduce(np.ones(1000, np.float32))
    return os.getpid()


def _die_after_one(pg):
    pg.allreduce(np.ones(10, np.float32))
    if pg.rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    pg.allreduce(np.ones(10, np.float32))


@needs_dpdk
def test_a_closed_job_leaves_nothing(erdma_world, short_dir):
    world = erdma_world(3, {"transport.name": "dpdk", "transport.dpdk.run_dir": str(short_dir)})
    pids = world.run(_pid)
    sockets = sorted(p.name for p in short_dir.rglob("*.sock"))
    assert len(sockets) == 3 and all(any(f".{pid}." in s for s in sockets) for pid in pids[:2]), sockets
    world.close()
    assert not list(short_dir.rglob("*.sock"))
    assert not [p for p in eal.runtime_root().glob("erdma-*") if eal._pid_in(p.name) in pids]


@needs_dpdk
def test_a_killed_ranks_sockets_are_removed_by_the_next_rank_that_starts(erdma_world, short_dir):
    config = {"transport.name": "dpdk", "transport.dpdk.run_dir": str(short_dir), "timeouts.collective": 30.0}
    world = erdma_world(3, config, timeout=20)
    outcomes = world.outcomes(_die_after_one)
    assert "died" in outcomes[0], outcomes
    world.close()
    left = sorted(p.name for p in short_dir.rglob("*.sock"))
    assert len(left) == 2 and all(name.startswith("memif-0-") for name in left), left  # rank 0 served both
    erdma_world(2, config).run(_pid)
    assert not [p for p in short_dir.rglob("memif-0-*.sock") if p.name in left]


@needs_dpdk
def test_a_run_dir_too_deep_for_a_socket_address_is_named(erdma_world, tmp_path):
    """A memif socket path over 107 bytes: DPDK said only "No such file or directory" (a pytest-xdist worker's
    tmp_path did it); the error names the path, the limit and the option."""
    deep = tmp_path / ("d" * 100)
    config = {"transport.name": "dpdk", "transport.dpdk.run_dir": str(deep), "timeouts.connect": 5.0}
    with pytest.raises(RankFailure) as failed:
        erdma_world(2, config)  # set-up fails
    said = r"rank 0: the memif socket path .* bytes, over the 107 a Unix socket's address holds: set " \
           r"transport\.dpdk\.run_dir \(now '.*d{100}'\)"
    assert re.match(said, str(failed.value.errors[0])), failed.value.errors


@needs_dpdk
def test_ranks_exit_cleanly_after_their_peers_disconnect():
    """``erdma bench`` starts ranks as processes that exit normally (atexit runs): with rte_eal_cleanup at
    exit, rank 0 died of SIGSEGV on DPDK's interrupt thread every time after a 16 MiB allreduce."""
    erdma = Path(sys.executable).with_name("erdma")
    run = subprocess.run([str(erdma), "bench", "-n", "2", "--op", "allreduce", "--sizes", "16M", "--iters", "2",
                          "--warmup", "1"], env={**os.environ, "ERDMA_TRANSPORT": "dpdk"}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "16777216" in run.stdout


@needs_dpdk
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a mount namespace needs root")
def test_a_full_run_time_folder_is_an_error_naming_it_not_a_crash(tmp_path):
    """DPDK's run-time folder on a 1 MiB tmpfs (in a mount namespace of the test's own): the rank says so
    and exits 1; it used to die of SIGBUS with no message."""
    code = ("from erdma_dpdk import eal\n"
            "try:\n    eal.start(256)\nexcept eal.DpdkError as exc:\n    print(exc)\n    raise SystemExit(1)\n")
    run = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f"mkdir -p {eal.runtime_root()} && mount -t tmpfs -o size=1m tmpfs {eal.runtime_root()} "
                          f"&& exec {sys.executable} -c '{code}'"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
    assert f"DPDK's run-time folder {eal.runtime_root()} has 1.0 MiB free" in run.stdout
    assert "dies of SIGBUS when they cannot grow: free space there" in run.stdout
