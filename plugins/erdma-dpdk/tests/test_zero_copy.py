"""memif's zero-copy client mode, seen in what each end of a pair maps: with it (the default) the server maps
the client's own DPDK memory, and the region memif makes holds only the rings; without it the region holds the
rings and a buffer for every slot, which both ends copy through. Results are checked in both modes. A process
lends its memory to one port only, ever (``eal.lend_memory``: DPDK 22.11 closes the EAL's own descriptor)."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import pytest

from .conftest import needs_dpdk

SLOTS = 2 * 1024 * 9000  # a copy-mode region's buffers: a ring each way of 2^memif_ring_log2 9000-byte frames

_MAP = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ (\d+)\s+/memfd:(\S+)")


def _memory(pg) -> dict[str, Any]:
    """This rank's result check, and the shared memory files it maps: DPDK's own (``nohuge``, one per process
    whose memory is mapped here, told apart by inode) and memif's regions (bytes)."""
    n = pg.size()
    x = np.arange(1 << 20, dtype=np.float32) * (pg.rank() + 1)
    pg.allreduce(x)
    ok = bool(np.array_equal(x, np.arange(1 << 20, dtype=np.float32) * (n * (n + 1) // 2)))
    dpdk: set[int] = set()
    regions: dict[int, int] = {}
    with open(f"/proc/{os.getpid()}/maps") as maps:
        for line in maps:
            if m := _MAP.match(line):
                size, inode, name = int(m[2], 16) - int(m[1], 16), int(m[3]), m[4]
                if name == "nohuge":
                    dpdk.add(inode)
                elif name.startswith("memif_region"):
                    regions[inode] = regions.get(inode, 0) + size
    return {"ok": ok, "dpdk_files": len(dpdk), "regions": sorted(regions.values())}


@needs_dpdk
@pytest.mark.parametrize("zero_copy", [True, False])
def test_the_server_maps_the_clients_memory_only_in_zero_copy_mode(erdma_world, short_dir, zero_copy):
    config = {"transport.name": "dpdk", "transport.dpdk.run_dir": str(short_dir),
              "transport.dpdk.memif_zero_copy": zero_copy}
    server, client = erdma_world(2, config).run(_memory)
    assert server["ok"] and client["ok"], (server, client)
    assert client["dpdk_files"] == 1, client
    if zero_copy:
        assert server["dpdk_files"] == 2, server  # its own and the client's
        assert server["regions"] and max(server["regions"]) < 1 << 20, server  # rings only
    else:
        assert server["dpdk_files"] == 1, server
        assert server["regions"] and max(server["regions"]) >= SLOTS, server


def _again(pg, url: str, config: dict[str, Any]) -> dict[str, Any]:
    """A second job in the same processes, after the first one ended."""
    import erdma_core

    rank, size = pg.rank(), pg.size()
    pg.destroy()
    second = erdma_core.init(config, rank=rank, world_size=size, init_method=url)
    try:
        found = _memory(second)
        second.barrier()  # every rank has read its maps before any ends the job: a server unmaps a client's region
        return found      # when the client goes
    finally:
        second.destroy()


@needs_dpdk
def test_each_process_lends_its_memory_to_its_first_client_port_only(erdma_world, short_dir, tmp_path):
    """3 ranks: ranks 1 and 2 lend theirs to rank 0 (their first client ports); rank 2's port to rank 1 copies.
    A second job in the same processes copies everywhere."""
    config = {"transport.name": "dpdk", "transport.dpdk.run_dir": str(short_dir)}
    world = erdma_world(3, config)
    first = world.run(_memory)
    assert all(r["ok"] for r in first), first
    assert [r["dpdk_files"] for r in first] == [3, 1, 1], first  # rank 0 maps its own, rank 1's and rank 2's
    assert max(first[0]["regions"]) < 1 << 20, first  # rings only: both its clients lend their buffers
    for r in first[1:]:  # the pair (1, 2) copies through rank 2's region
        assert len(r["regions"]) == 2 and min(r["regions"]) < 1 << 20 <= SLOTS <= max(r["regions"]), first
    second = world.run(_again, f"file://{tmp_path}/second", config)
    assert all(r["ok"] for r in second), second
    assert [r["dpdk_files"] for r in second] == [1, 1, 1], second
    assert all(min(r["regions"]) >= SLOTS for r in second), second
