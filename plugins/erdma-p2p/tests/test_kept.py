"""A traversal's data socket outlives its set-up (``erdma_p2p.kept``): the next set-up of the process (an elastic
job's next epoch) runs on the same socket, with the mapping and the relay allocation an earlier one took, and asks
neither the STUN server nor the TURN server again. Against coturn on loopback (STUN and TURN), two ranks on
QUIC, each set-up's results checked against numpy."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

USER, PASSWORD = "erdma", "kept-secret"


@pytest.fixture
def turn(tmp_path):
    if shutil.which("turnserver") is None:
        pytest.skip("coturn is not installed (scripts/system-deps.sh test installs it)")
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    proc = subprocess.Popen(["turnserver", "-L", "127.0.0.1", "--relay-ip", "127.0.0.1", "-p", str(port),
                             "--lt-cred-mech", f"--user={USER}:{PASSWORD}", "--realm=erdma.test",
                             "--allow-loopback-peers", "--no-cli", "--no-tls", "--no-dtls",
                             "--pidfile", str(tmp_path / "turn.pid")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(5)


def _set_ups(pg, server: str, urls: list[str], keep_s: float) -> list[tuple[str, list[float]]]:
    """Set-ups one after another in this process, on the stun traversal with a relay: each's published
    candidates and allreduce result; a socket is kept ``keep_s`` seconds (``kept.KEEP_S``), and 0.2 s pass
    between set-ups."""
    from erdma_p2p import kept

    import erdma_core

    kept.KEEP_S = keep_s

    conf = {"transport.name": "quic", "traversal.name": "stun", "traversal.stun.server": server,
            "traversal.stun.relay": server, "traversal.stun.relay_user": USER,
            "traversal.stun.relay_password": PASSWORD, "timeouts.connect": 30.0,
            "security.secret": "kept-test"}
    out = []
    for url in urls:
        group = erdma_core.init(conf, rank=pg.rank(), world_size=pg.size(), init_method=url)
        arr = np.arange(64, dtype=np.float32) * (pg.rank() + 1)
        group.allreduce(arr)
        out.append((group.rt.store.get(f"quic/addr/{pg.rank()}", 5.0).decode(), arr.tolist()))
        group.destroy()
        time.sleep(0.2)
    kept.release()
    return out


@pytest.mark.parametrize("keep_s, kept_across", [(25.0, True), (0.1, False)], ids=["kept", "idle-too-long"])
def test_a_set_up_runs_on_the_socket_and_allocation_of_the_one_before(turn, tmp_path, keep_s, kept_across):
    """``idle-too-long``: a socket unused for longer than ``KEEP_S`` is given back, and the next set-up
    gathers anew."""
    from erdma_core.testing.world import World

    server = turn
    urls = [f"file://{tmp_path / f'store-{i}'}" for i in range(3)]
    with World(2, {"transport.name": "tcp"}) as world:
        out = world.run(_set_ups, server, urls, keep_s)
    want = (np.arange(64, dtype=np.float32) * 3).tolist()
    for set_ups in out:
        assert [arr for _, arr in set_ups] == [want] * 3
        published = [cands for cands, _ in set_ups]
        assert all(" relay" in c and " srflx" in c for c in published), published
        if kept_across:  # the same socket (its mapping) and the same relayed address, three times: a new
            assert published == [published[0]] * 3, published  # allocation beside a held one has another port
        else:
            assert len(set(published)) == 3, published
