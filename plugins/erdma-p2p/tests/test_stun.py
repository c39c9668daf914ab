"""The STUN Binding transaction, sans-IO: requests and retransmissions as data, strict parsing of what comes
back; then against a real coturn on loopback."""

from __future__ import annotations

import socket
import struct
import time

import numpy as np
import pytest
from erdma_p2p import stun

from erdma_core.toolkit import meet

TXID = bytes(range(12))


def response(kind: int, attrs: list[tuple[int, bytes]], txid: bytes = TXID) -> bytes:
    body = b"".join(struct.pack("!HH", t, len(v)) + v + b"\0" * (-len(v) % 4) for t, v in attrs)
    return struct.pack("!HHI12s", kind, len(body), stun.MAGIC, txid) + body


def xor_address(host: str, port: int) -> bytes:
    raw = bytes(a ^ b for a, b in zip(socket.inet_aton(host), struct.pack("!I", stun.MAGIC), strict=True))
    return struct.pack("!BBH", 0, 1, port ^ (stun.MAGIC >> 16)) + raw


def test_a_success_response_gives_the_xor_mapped_address():
    data = response(stun.BINDING_SUCCESS, [(0x8022, b"coturn"), (stun.XOR_MAPPED_ADDRESS, xor_address("203.0.113.7", 40001))])
    assert stun.parse(data, TXID) == ("203.0.113.7", 40001)
    plain = response(stun.BINDING_SUCCESS, [(stun.MAPPED_ADDRESS, struct.pack("!BBH4s", 0, 1, 5000,
                                                                                socket.inet_aton("192.0.2.1")))])
    assert stun.parse(plain, TXID) == ("192.0.2.1", 5000)


def test_an_error_response_says_the_code():
    got = stun.parse(response(stun.BINDING_ERROR, [(stun.ERROR_CODE, b"\0\0\x04\x00Bad Request")]), TXID)
    assert isinstance(got, stun.StunError) and str(got) == "STUN error 400: Bad Request"


@pytest.mark.parametrize("data", [
    b"", b"\0" * 19, b"\0" * 600,
    response(stun.BINDING_SUCCESS, [(stun.XOR_MAPPED_ADDRESS, xor_address("1.2.3.4", 1))], txid=b"x" * 12),
    response(stun.BINDING_SUCCESS, [(stun.XOR_MAPPED_ADDRESS, xor_address("1.2.3.4", 1))])[:-4],  # cut short
    response(stun.BINDING_SUCCESS, [(stun.XOR_MAPPED_ADDRESS, b"\0\2" + b"\0" * 18)]),  # IPv6: not ours
    response(stun.BINDING_REQUEST, []),
    response(stun.BINDING_SUCCESS, []),
    struct.pack("!HHI12s", stun.BINDING_SUCCESS, 400, stun.MAGIC, TXID) + b"\0" * 8,  # length lies
    struct.pack("!HHI12sHH", stun.BINDING_SUCCESS, 4, stun.MAGIC, TXID, 0x20, 200),  # attribute length lies
    b"\x00erdma-punch",
])
def test_anything_else_is_ignored(data):
    assert stun.parse(data, TXID) is None


def test_requests_are_resent_with_doubling_waits_then_the_transaction_fails():
    b = stun.Binding(rto=0.5, sends=3, last_wait=4, txid=TXID)
    first = b.start(100.0)
    assert first == stun.request(TXID) and b.timer == 100.5
    assert b.on_timer(100.4) is None  # not yet
    assert b.on_timer(100.5) == first and b.timer == 101.5
    assert b.on_timer(101.5) == first and b.timer == 103.5  # the last send waits rto x last_wait
    assert b.on_timer(103.5) is None and isinstance(b.result, stun.StunError)


def test_the_answer_ends_the_transaction():
    b = stun.Binding(txid=TXID)
    b.start(0.0)
    b.on_datagram(b"junk")
    assert b.result is None
    b.on_datagram(response(stun.BINDING_SUCCESS, [(stun.XOR_MAPPED_ADDRESS, xor_address("198.51.100.9", 7))]))
    assert b.result == ("198.51.100.9", 7) and b.timer is None and b.on_timer(99.0) is None


def test_coturn_tells_a_socket_its_own_address_on_loopback(coturn):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    assert stun.query(s, coturn, 5.0) == s.getsockname()


def test_no_server_is_a_clear_error_within_the_timeout():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    start = time.monotonic()
    with pytest.raises(stun.StunError, match=r"no STUN answer from 127\.0\.0\.1:9 within 0\.6s"):
        stun.query(s, ("127.0.0.1", 9), 0.6, rto=0.1)
    assert time.monotonic() - start < 5.0  # bounded, not hung (0.6 s asked)


def test_coturn_tells_a_tcp_port_its_own_address_on_loopback(coturn):
    held = meet.bound_to(("127.0.0.1", 0))  # the port a transport meets from; the query binds beside it
    try:
        assert stun.query_tcp(held.getsockname(), coturn, 5.0) == held.getsockname()
    finally:
        held.close()


def test_no_tcp_answer_is_a_clear_error_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(stun.StunError, match=r"no STUN answer over TCP from 127\.0\.0\.1:9 within 0\.6s"):
        stun.query_tcp(("127.0.0.1", 0), ("127.0.0.1", 9), 0.6)
    assert time.monotonic() - start < 5.0


def _paths_and_sum(pg):
    arr = np.arange(1000, dtype=np.float32) * (pg.rank() + 1)
    pg.allreduce(arr)
    return pg.transport.paths(), arr, pg.store.get(f"tcp/meet/{pg.rank()}", 1.0).decode()


def test_tcp_meets_its_peers_from_the_port_the_stun_traversal_prepared(coturn):
    """The built-in TCP with ``traversal = "stun"``: each rank's TCP port, its mapping learned over TCP, is
    where it meets every peer (on loopback the mapping is the address itself: a srflx candidate only)."""
    from erdma_core.testing.world import World

    conf = {"traversal.name": "stun", "traversal.stun.server": f"{coturn[0]}:{coturn[1]}", "transport.name": "tcp",
            "transport.tcp.local_sockets": False}
    with World(3, conf) as world:
        out = world.run(_paths_and_sum)
    published = [c.rsplit(" ", 1) for _, _, c in out]
    assert [kind for _, kind in published] == ["srflx"] * 3
    for rank, (paths, arr, _) in enumerate(out):
        assert np.array_equal(arr, np.arange(1000, dtype=np.float32) * 6)
        assert paths == {p: f"{published[p][0]} direct" for p in range(3) if p != rank}


@pytest.mark.parametrize("changes, message", [
    ({"punch": False}, "config key 'traversal.stun.punch': value False cannot be kept by transport.name = \"tcp\""),
])
def test_tcp_refuses_stun_settings_it_cannot_keep(changes, message):
    from erdma_p2p.traversal import StunTraversal

    from erdma_core.sdk import ConfigError

    section = {"server": "127.0.0.1:3478", "timeout": 1.0, "bind_address": "", "punch": True, "port": 0,
               "check_server": "", "relay": "", "relay_user": "", "relay_password": "", "relay_when": "fallback",
               "check_timeout": 2.0, "classify_server": ""}
    with pytest.raises(ConfigError) as err:
        StunTraversal(None, section | changes).tcp_socket()
    assert message in str(err.value)
