"""Discovery by env:// (as torchrun sets it), tcp://host:port and file://path, and the stores."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from erdma_core import CollectiveTimeoutError, ConfigError, ErdmaError, PluginError
from erdma_core.cli.launcher import free_port
from erdma_core.discovery import FileStore, TCPStore
from erdma_core.testing import World


def where_am_i(pg):
    arr = np.array([pg.rank() + 1], np.int64)
    pg.allreduce(arr)
    return pg.rank(), pg.size(), int(arr[0])


def test_tcp_init_method():
    with World(3, init_method=f"tcp://127.0.0.1:{free_port()}", timeout=30) as w:
        assert w.run(where_am_i) == [(r, 3, 6) for r in range(3)]


def test_file_init_method_and_reuse_after_cleanup(tmp_path):
    for _ in range(2):  # the second job finds the folder emptied by the first one's rank 0
        with World(2, init_method=f"file://{tmp_path}/rdv", timeout=30) as w:
            assert w.run(where_am_i) == [(0, 2, 3), (1, 2, 3)]
        assert list((tmp_path / "rdv").iterdir()) == []


def test_env_init_method_without_arguments(tmp_path):
    """erdma_core.init() with no arguments reads MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE."""
    import os
    import subprocess
    import sys

    port = free_port()
    script = ("import erdma_core, numpy as np\npg = erdma_core.init()\na = np.ones(3)\npg.allreduce(a)\n"
              "print(pg.rank(), pg.size(), a.tolist())\npg.destroy()\n")
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(r), "WORLD_SIZE": "2"}) for r in range(2)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert outs == ["0 2 [2.0, 2.0, 2.0]", "1 2 [2.0, 2.0, 2.0]"]


def test_env_init_method_names_missing_variables(monkeypatch):
    import erdma_core

    for var in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="needs the environment variables MASTER_ADDR, MASTER_PORT"):
        erdma_core.init(rank=0, world_size=1)
    with pytest.raises(PluginError, match="Unknown discovery 'udp'; installed: env, etcd, file, tcp"):
        erdma_core.init(rank=0, world_size=1, init_method="udp://x:1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="no rank given and RANK is not set"):
        erdma_core.init(world_size=1)


def test_tcp_store_set_get_add_and_timeout():
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_server=True, timeout=5)
    client = TCPStore("127.0.0.1", port, is_server=False, timeout=5)
    threading.Timer(0.2, lambda: server.set("late", b"v")).start()
    assert client.get("late", 5) == b"v"
    assert [client.add("n", 2), server.add("n", 3)] == [2, 5]
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="key 'never' did not appear"):
        client.get("never", 0.3)
    assert time.monotonic() - start < 5
    client.close()
    server.close()


def test_a_store_that_goes_away_names_who_served_it():
    """Before: a rank still in set-up when rank 0 (the store's server) failed said only "discovery store at
    ... failed: Connection reset by peer", which reads as a network fault."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "import sys, time; from erdma_core.discovery import TCPStore; "
                               f"TCPStore('127.0.0.1', {port}, is_server=True, timeout=5); print(flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE)
    assert server.stdout is not None and server.stdout.readline() == b"\n"
    client = TCPStore("127.0.0.1", port, is_server=False, timeout=5, served_by="rank 0")
    threading.Timer(0.3, server.kill).start()  # the serving process dies
    with pytest.raises(ErdmaError) as info:
        client.get("never", 10)
    server.wait()
    assert not isinstance(info.value, TimeoutError)
    assert f"discovery: the store at 127.0.0.1:{port} is gone (" in str(info.value)
    assert str(info.value).endswith("): rank 0 has exited or failed, and this rank cannot go on without it (the "
                                    "cause is rank 0's own error)")
    client.close()


def test_tcp_store_unreachable_times_out():
    with pytest.raises(CollectiveTimeoutError, match="cannot reach the store"):
        TCPStore("127.0.0.1", free_port(), is_server=False, timeout=0.5)


def test_file_store(tmp_path):
    a, b = FileStore(tmp_path), FileStore(tmp_path)
    a.set("x/y", b"1")
    assert b.get("x/y", 1) == b"1"
    assert [a.add("c", 1), b.add("c", 1)] == [1, 2]
    with pytest.raises(CollectiveTimeoutError, match="did not appear in the folder"):
        b.get("nope", 0.1)


def listening_address(pg):
    conn = pg.transport.channels[1 - pg.rank()]
    return conn.sock.getsockname()[0], where_am_i(pg)


def test_interface_option_binds_that_interface():
    with World(2, {"transport.tcp.interface": "lo", "transport.tcp.local_sockets": False}, timeout=30) as w:
        assert [addr for addr, _ in w.run(listening_address)] == ["127.0.0.1", "127.0.0.1"]


def test_unknown_interface_is_a_config_error():
    from erdma_core.testing import RankFailure

    with pytest.raises(RankFailure) as info:
        World(1, {"transport.tcp.interface": "nope0"}, timeout=30)
    err = info.value.errors[0]
    assert isinstance(err, ConfigError)
    assert "config key 'transport.tcp.interface': value 'nope0' has no IPv4 address" in str(err)
    assert "interfaces here: lo" in str(err)
