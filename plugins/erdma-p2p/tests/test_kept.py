"""A traversal's data socket outlives its set-up (``erdma_p2p.kept``): the next set-up of the process (an elastic
job's next epoch) runs on the same socket, with the mapping and the relay allocation an earlier one took, and asks
neither the STUN server nor the TURN server again. Against coturn on loopback (STUN and TURN), two ranks on
QUIC, each set-up's results checked against numpy."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest


def _set_ups(pg, relay: tuple[str, str, str], urls: list[str], keep_s: float) -> list[tuple[str, list[float]]]:
    """Set-ups one after another in this process, on the stun traversal with a relay: each's published
    candidates and allreduce result; a socket is kept ``keep_s`` seconds (``kept.KEEP_S``), and 0.2 s pass
    between set-ups."""
    from erdma_p2p import kept

    import erdma_core

    kept.KEEP_S = keep_s

    server, user, password = relay
    conf = {"transport.name": "quic", "traversal.name": "stun", "traversal.stun.server": server,
            "traversal.stun.relay": server, "traversal.stun.relay_user": user, "traversal.stun.relay_password": password,
            "timeouts.connect": 30.0,
            "security.secret": "kept-test"}
    out = []
    for i, url in enumerate(urls):
        try:
            group = erdma_core.init(conf, rank=pg.rank(), world_size=pg.size(), init_method=url)
        except erdma_core.ErdmaError as exc:  # (which set-up, and what each rank published: it failed once in CI
            # at 0be4967, both ranks unreached over QUIC in 30 s, and passed here 22 times, 8 beside 3 busy loops)
            raise erdma_core.ErdmaError(f"set-up {i + 1} of {len(urls)}: {exc}; published before: {out}") from exc

        arr = np.arange(64, dtype=np.float32) * (pg.rank() + 1)
        group.allreduce(arr)
        out.append((group.store.get(f"quic/addr/{pg.rank()}", 5.0).decode(), arr.tolist()))
        group.destroy()
        time.sleep(0.2)
    kept.release()
    return out


@pytest.mark.parametrize("keep_s, kept_across", [(25.0, True), (0.1, False)], ids=["kept", "idle-too-long"])
def test_a_set_up_runs_on_the_socket_and_allocation_of_the_one_before(turn_relay, tmp_path, keep_s, kept_across):
    """``idle-too-long``: a socket unused for longer than ``KEEP_S`` is given back, and the next set-up
    gathers anew."""
    from erdma_core.testing.world import World

    urls = [f"file://{tmp_path / f'store-{i}'}" for i in range(3)]
    with World(2, {"transport.name": "tcp"}) as world:
        out = world.run(_set_ups, turn_relay, urls, keep_s)
    want = (np.arange(64, dtype=np.float32) * 3).tolist()
    for set_ups in out:
        assert [arr for _, arr in set_ups] == [want] * 3
        published = [cands for cands, _ in set_ups]
        assert all(" relay" in c and " srflx" in c for c in published), published
        if kept_across:  # the same socket (its mapping) and the same relayed address, three times: a new
            assert published == [published[0]] * 3, published  # allocation beside a held one has another port
        else:
            assert len(set(published)) == 3, published


def test_a_kept_relayed_socket_whose_server_has_not_heard_from_it_lately_is_given_back():
    """A relayed socket is lent again only while its last datagram to the TURN server is younger than KEEP_S
    (the NAT's binding to the server is then still there) and its allocation has time left; otherwise it is
    given back (closed, its allocation released) and the set-up gathers anew."""
    from erdma_p2p import kept, turn
    from erdma_p2p.relayed import RelayedSocket
    from erdma_p2p.stun import Mapped

    def prepared(now: float, last_sent: float, ends: float) -> kept.Prepared:
        raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        raw.bind(("127.0.0.1", 0))
        client = turn.TurnClient("u", "p")
        client.relayed, client.last_sent, client._ends = Mapped("198.51.100.1", 50000), last_sent, ends
        p = kept.Prepared(RelayedSocket(raw, client, ("127.0.0.1", 9)), Mapped("198.51.100.9", 4000))
        p.lend().close()  # a set-up used it, and is over
        return p

    now = time.monotonic()
    key = ("test", now)
    fresh, quiet, ending = (prepared(now, now - 5.0, now + 600.0), prepared(now, now - kept.KEEP_S - 1, now + 600.0),
                            prepared(now, now - 5.0, now + kept.MARGIN_S - 1))
    for p in (quiet, ending, fresh):
        kept._kept.setdefault(key, []).append(p)
    try:
        got = kept.take(key, now)
        assert got is not None and got[0] is fresh and isinstance(got[1], RelayedSocket)
        assert kept._kept[key] == [fresh]  # the other two were given back
        assert quiet.sock.sock.fileno() == -1 and ending.sock.sock.fileno() == -1
        got[1].close()
    finally:
        kept.release()


def test_an_icmp_error_the_last_set_up_left_on_a_kept_socket_is_not_the_next_ones():
    """A transport asks for ICMP errors (``IP_RECVERR``, as erdma-quic's endpoint does); one comes back for its
    last datagram, to a port nobody holds, after it closed. The next set-up's lease neither fails its first send
    with it nor finds it queued."""
    from erdma_p2p import kept
    from erdma_p2p.stun import Mapped

    raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    raw.bind(("127.0.0.1", 0))
    raw.setsockopt(socket.IPPROTO_IP, 11, 1)  # IP_RECVERR
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    nobody = closed.getsockname()
    closed.close()
    key = ("icmp", time.monotonic())
    try:
        first = kept.keep(key, kept.Prepared(raw, Mapped("198.51.100.9", 4000)))
        first.sendto(b"to nobody", nobody)
        time.sleep(0.2)  # the kernel's port unreachable comes back at once on loopback
        first.close()
        got = kept.take(key, time.monotonic())
        assert got is not None
        lease = got[1]
        lease.setblocking(False)
        with pytest.raises(BlockingIOError):
            lease.recvmsg(1, 512, socket.MSG_ERRQUEUE)
        lease.sendto(b"hello", listener.getsockname())
        assert listener.recvfrom(64)[0] == b"hello"
        lease.close()
    finally:
        kept.release()
        listener.close()
