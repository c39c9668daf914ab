"""The TURN client's state machine against a scripted server: the credential round, integrity both ways,
permissions and channels, data framing both ways, retransmission and refresh timing, and junk ignored."""

from __future__ import annotations

import hashlib
import struct

import pytest
from erdma_p2p import turn
from erdma_p2p.stun import attributes

KEY = hashlib.md5(b"alice:erdma.test:secret", usedforsecurity=False).digest()
RELAYED = ("198.51.100.1", 50000)
PEER = ("198.51.100.11", 40000)


def parse(data: bytes) -> tuple[int, bytes, dict[int, bytes]]:
    kind, length, magic, txid = struct.unpack_from("!HHI12s", data)
    assert magic == turn.MAGIC and length == len(data) - 20
    attrs = attributes(data[20:])
    assert attrs is not None
    return kind, txid, attrs


def answer(kind: int, txid: bytes, *attrs: tuple[int, bytes], key: bytes | None = KEY) -> bytes:
    return turn.message(kind, txid, b"".join(turn._attr(k, v) for k, v in attrs), key)


def error(method: int, txid: bytes, code: int, *more: tuple[int, bytes]) -> bytes:
    return answer(method | turn.ERROR, txid, (turn.ERROR_CODE, struct.pack("!HBB", 0, code // 100, code % 100) + b"no"),
                  *more, key=None)


def allocated(now: float = 0.0) -> turn.TurnClient:
    """A client through the 401 round to a granted allocation (lifetime 600 s)."""
    c = turn.TurnClient("alice", "secret")
    c.start(now)
    (first,) = c.outgoing()
    kind, txid, attrs = parse(first)
    assert kind == turn.ALLOCATE and turn.MESSAGE_INTEGRITY not in attrs and turn.REQUESTED_TRANSPORT in attrs
    c.on_datagram(error(turn.ALLOCATE, txid, 401, (turn.REALM, b"erdma.test"), (turn.NONCE, b"n1")), now)
    (second,) = c.outgoing()
    kind, txid, attrs = parse(second)
    assert attrs[turn.USERNAME] == b"alice" and attrs[turn.NONCE] == b"n1" and turn.integrity_ok(second, KEY)
    c.on_datagram(answer(turn.ALLOCATE | turn.SUCCESS, txid, (turn.XOR_RELAYED_ADDRESS, turn.xor_address(*RELAYED)),
                         (turn.XOR_MAPPED_ADDRESS, turn.xor_address("198.51.100.12", 1234)),
                         (turn.LIFETIME, struct.pack("!I", 600))), now)
    assert c.relayed == RELAYED and c.mapped == ("198.51.100.12", 1234) and c.error is None
    return c


def test_allocation_through_the_credential_round():
    allocated()


def test_integrity_detects_any_change():
    msg = answer(turn.ALLOCATE | turn.SUCCESS, b"t" * 12, (turn.LIFETIME, b"\0\0\0\1"))
    assert turn.integrity_ok(msg, KEY)
    assert not turn.integrity_ok(msg, b"k" * 16)
    for i in (1, 8, 25):
        bad = bytearray(msg)
        bad[i] ^= 1
        assert not turn.integrity_ok(bytes(bad), KEY)
    assert not turn.integrity_ok(answer(turn.ALLOCATE | turn.SUCCESS, b"t" * 12, key=None), KEY)


def challenged(password: str) -> tuple[turn.TurnClient, bytes]:
    """A client whose Allocate got the 401, and the id of its second (credentialed) Allocate."""
    c = turn.TurnClient("alice", password)
    c.start(0.0)
    _, txid, _ = parse(c.outgoing()[0])
    c.on_datagram(error(turn.ALLOCATE, txid, 401, (turn.REALM, b"erdma.test"), (turn.NONCE, b"n1")), 0.0)
    return c, parse(c.outgoing()[0])[1]


def test_an_unsigned_success_is_ignored():
    c, txid = challenged("secret")
    forged = answer(turn.ALLOCATE | turn.SUCCESS, txid, (turn.XOR_RELAYED_ADDRESS, turn.xor_address(*RELAYED)),
                    key=b"x" * 16)
    assert c.on_datagram(forged, 0.0) is None and c.relayed is None and c.error is None


def test_wrong_credentials_fail_the_allocation_with_the_servers_reason():
    c, txid = challenged("wrong")
    c.on_datagram(error(turn.ALLOCATE, txid, 401, (turn.REALM, b"erdma.test"), (turn.NONCE, b"n2")), 0.0)
    assert c.relayed is None and str(c.error) == "the TURN server refused Allocate: error 401 no"


def test_a_stale_nonce_is_retried_with_the_new_one():
    c = allocated()
    c.wrap(b"x", *PEER, now=1.0)
    perm = next(m for m in c.outgoing() if parse(m)[0] == turn.CREATE_PERMISSION)
    c.on_datagram(error(turn.CREATE_PERMISSION, parse(perm)[1], 438, (turn.NONCE, b"n2")), 1.0)
    (again,) = c.outgoing()
    kind, _, attrs = parse(again)
    assert kind == turn.CREATE_PERMISSION and attrs[turn.NONCE] == b"n2" and turn.integrity_ok(again, KEY)


def test_data_goes_as_send_indication_until_the_channel_is_bound_then_as_channel_data():
    c = allocated()
    first = c.wrap(b"hello", *PEER, now=1.0)
    kind, _, attrs = parse(first)
    assert kind == turn.SEND | turn.INDICATION and attrs[turn.DATA] == b"hello"
    assert attrs[turn.XOR_PEER_ADDRESS] == turn.xor_address(*PEER)
    asked = {parse(m)[0]: m for m in c.outgoing()}
    assert set(asked) == {turn.CREATE_PERMISSION, turn.CHANNEL_BIND}
    assert parse(c.wrap(b"again", *PEER, now=1.1))[0] == turn.SEND | turn.INDICATION  # not bound yet
    assert c.outgoing() == []  # asked once
    bind = asked[turn.CHANNEL_BIND]
    channel = struct.unpack("!H", parse(bind)[2][turn.CHANNEL_NUMBER][:2])[0]
    c.on_datagram(answer(turn.CHANNEL_BIND | turn.SUCCESS, parse(bind)[1]), 1.2)
    assert c.wrap(b"bound", *PEER, now=1.3) == struct.pack("!HH", channel, 5) + b"bound"


def test_data_from_peers_comes_back_with_their_address():
    c = allocated()
    c.wrap(b"x", *PEER, now=1.0)
    bind = next(m for m in c.outgoing() if parse(m)[0] == turn.CHANNEL_BIND)
    channel = struct.unpack("!H", parse(bind)[2][turn.CHANNEL_NUMBER][:2])[0]
    assert c.on_datagram(struct.pack("!HH", channel, 3) + b"abc\0", 2.0) == (b"abc", PEER)  # padding ignored
    ind = answer(turn.DATA_IND | turn.INDICATION, b"i" * 12, (turn.XOR_PEER_ADDRESS, turn.xor_address("203.0.113.5", 7)),
                 (turn.DATA, b"hi"), key=None)
    assert c.on_datagram(ind, 2.0) == (b"hi", ("203.0.113.5", 7))


@pytest.mark.parametrize("junk", [b"", b"\x40\x00\x00\x09abc", b"\x7f\xff\x00\x01a", b"\x00\x01\x00\x00" + b"x" * 16,
                                  b"\x00\x17\x00\x04" + struct.pack("!I", turn.MAGIC) + b"t" * 12 + b"\0\x13\0\x08"])
def test_junk_from_the_server_is_ignored(junk):
    c = allocated()
    assert c.on_datagram(junk, 1.0) is None and c.error is None and c.outgoing() == []


def test_requests_are_resent_then_fail():
    c = turn.TurnClient("alice", "secret", rto=0.5, sends=3)
    c.start(0.0)
    assert len(c.outgoing()) == 1 and c.timer == 0.5
    c.on_timer(0.4)
    assert c.outgoing() == []
    c.on_timer(0.5)
    assert len(c.outgoing()) == 1 and c.timer == 1.5
    c.on_timer(1.5)
    assert len(c.outgoing()) == 1
    c.on_timer(3.5)
    assert c.outgoing() == [] and str(c.error) == "no answer from the TURN server to Allocate"


def test_allocation_permissions_and_channels_are_refreshed_before_they_expire():
    c = allocated(0.0)
    c.wrap(b"x", *PEER, now=0.0)
    for m in c.outgoing():
        c.on_datagram(answer(parse(m)[0] | turn.SUCCESS, parse(m)[1]), 0.0)
    assert c.timer == turn.KEEPALIVE_S  # (test_the_server_hears_from_an_idle_socket_every_15_s)
    c.on_timer(turn.PERMISSION_REFRESH)
    (perm,) = c.outgoing()
    assert parse(perm)[0] == turn.CREATE_PERMISSION
    c.on_datagram(answer(turn.CREATE_PERMISSION | turn.SUCCESS, parse(perm)[1]), turn.PERMISSION_REFRESH)
    c.on_timer(300.0)  # half the allocation's and the channel's lifetime
    kinds = sorted(parse(m)[0] for m in c.outgoing())
    assert kinds == [turn.REFRESH, turn.CHANNEL_BIND]


def test_the_server_hears_from_an_idle_socket_every_15_s():
    """A Binding indication (no answer asked for) when nothing else went to the server for KEEPALIVE_S: it holds
    the NAT's binding of the socket to the server, by which the relay reaches this rank."""
    c = allocated(0.0)
    assert c.timer == turn.KEEPALIVE_S == 15.0
    c.on_timer(14.9)
    assert c.outgoing() == []
    c.on_timer(15.0)
    (keepalive,) = c.outgoing()
    kind, _, attrs = parse(keepalive)
    assert kind == turn.BINDING | turn.INDICATION and attrs == {} and c.timer == 30.0
    c.wrap(b"data", *PEER, now=20.0)  # data to the server: the next keepalive is 15 s after it
    for m in c.outgoing():  # (the permission and the channel it asked for, granted)
        c.on_datagram(answer(parse(m)[0] | turn.SUCCESS, parse(m)[1]), 20.0)
    c.on_timer(30.0)
    assert [parse(m)[0] for m in c.outgoing()] == [] and c.timer == 35.0


def test_close_releases_the_allocation():
    c = allocated()
    c.close(1.0)
    (bye,) = c.outgoing()
    kind, _, attrs = parse(bye)
    assert kind == turn.REFRESH and attrs[turn.LIFETIME] == b"\0\0\0\0" and turn.integrity_ok(bye, KEY)


SECTION = {"server": "127.0.0.1:3478", "timeout": 1.0, "bind_address": "", "punch": True, "port": 0,
           "check_server": "", "relay": "127.0.0.1:3478", "relay_user": "u", "relay_password": "p",
           "relay_when": "fallback", "check_timeout": 2.0, "classify_server": ""}


@pytest.mark.parametrize("changes, message", [
    ({"relay_when": "always", "relay": ""}, "config key 'traversal.stun.relay_when': value 'always' needs "
     "traversal.stun.relay"),
    ({"relay_password": ""}, "config key 'traversal.stun.relay': a TURN server needs "
     "traversal.stun.relay_user and traversal.stun.relay_password"),
    ({"relay": "nowhere"}, "config key 'traversal.stun.relay': value 'nowhere' is not HOST:PORT"),
])
def test_relay_settings_that_cannot_work_are_refused_naming_the_key(changes, message):
    from erdma_p2p.traversal import StunTraversal

    from erdma_core.sdk import ConfigError

    with pytest.raises(ConfigError) as err:
        StunTraversal(None, SECTION | changes)
    assert message in str(err.value)


def test_the_classification_setting_of_old_is_refused_naming_the_choices():
    from erdma_core import load_config
    from erdma_core.sdk import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config({"traversal.name": "stun", "traversal.stun.relay_when": "dependent-mapping"})
    assert "traversal.stun.relay_when" in str(err.value) and "'dependent-mapping'" in str(err.value)
    assert "fallback" in str(err.value) and "always" in str(err.value)


def test_candidates_and_the_order_a_dialler_tries_them():
    """Published: own address, NAT mapping, relay. Dialled: a peer's own address only from behind the same
    public address (the same site), then its mapping, then its relay; only the relay with "always"."""
    from erdma_p2p import stun
    from erdma_p2p.traversal import StunTraversal

    from erdma_core.sdk import Candidate

    t = StunTraversal(None, SECTION | {"bind_address": "10.1.0.2"})
    t.mapped, t.local_port, t.relayed = stun.Mapped("198.51.100.10", 4000), 5000, stun.Mapped("198.51.100.1", 6000)
    assert t.candidates("10.1.0.2", 5000) == [Candidate("10.1.0.2", 5000, "host"),
                                              Candidate("198.51.100.10", 4000, "srflx"),
                                              Candidate("198.51.100.1", 6000, "relay")]
    elsewhere = [Candidate("10.2.0.2", 7000, "host"), Candidate("198.51.100.11", 7000, "srflx"),
                 Candidate("198.51.100.1", 7001, "relay")]
    assert t.dial_plan(elsewhere) == (elsewhere[1:], 2.0)
    same_site = [Candidate("10.1.0.3", 7000, "host"), Candidate("198.51.100.10", 7002, "srflx"),
                 Candidate("198.51.100.1", 7003, "relay")]
    assert t.dial_plan(same_site) == (same_site, 2.0)
    no_nat = [Candidate("198.51.100.12", 7000, "srflx")]  # a peer with no NAT publishes one direct candidate
    assert t.dial_plan(no_nat) == (no_nat, 2.0)
    always = StunTraversal(None, SECTION | {"relay_when": "always", "check_timeout": 0.5})
    assert always.dial_plan(elsewhere) == ([elsewhere[2]], 0.5)
    assert always.dial_plan(no_nat) == ([], 0.5)  # the transport refuses that, naming the candidates


def test_the_relayed_socket_answers_each_peer_the_way_it_came():
    """A peer heard from directly is answered directly (and the relay's timers still run); one heard from
    through the relay, through it (a Send indication, framed for that peer, to the server; GSO batches cut
    into datagrams), when answered at the address as heard (a ``Via``: what a QUIC connection keeps), while
    another connection of the same peer's that came directly is answered directly; a peer's permission is
    asked for on demand."""
    import socket
    import time

    from erdma_p2p.relayed import RelayedSocket, Via

    server, peer, own = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3))
    for s in (server, peer, own):
        s.bind(("127.0.0.1", 0))
        s.settimeout(2.0)
    rs = RelayedSocket(own, allocated(time.monotonic() - 400), server.getsockname())  # its refresh is due
    there = peer.getsockname()

    def sent_to_server() -> list[tuple[int, dict[int, bytes]]]:
        got = []
        server.settimeout(0.2)
        try:
            while True:
                kind, _, attrs = parse(server.recvfrom(65536)[0])
                got.append((kind, attrs))
        except TimeoutError:
            return got

    peer.sendto(b"direct", own.getsockname())
    assert rs.recvfrom(65536) == (b"direct", there) and not rs.relayed(there)
    rs.sendto(b"back", there)
    assert peer.recvfrom(100) == (b"back", own.getsockname())
    # the allocation is refreshed on direct traffic too: the relay must be there when a path falls back to it
    assert [k for k, _ in sent_to_server()] == [turn.REFRESH]

    server.sendto(answer(turn.DATA_IND | turn.INDICATION, b"d" * 12, (turn.XOR_PEER_ADDRESS, turn.xor_address(*there)),
                         (turn.DATA, b"relayed"), key=None), own.getsockname())
    data, via = rs.recvfrom(65536)
    assert (data, via) == (b"relayed", there) and isinstance(via, Via) and rs.relayed(via) and not rs.relayed(there)
    rs.sendto(b"one", via)
    rs.sendmsg([b"aaaabbbbcc"], [(socket.SOL_UDP, 103, struct.pack("=H", 4))], 0, via)
    rs.sendto(b"other connection", there)  # the same peer's direct one
    assert peer.recvfrom(100)[0] == b"other connection"
    data = [a[turn.DATA] for k, a in sent_to_server() if k == turn.SEND | turn.INDICATION]
    assert data == [b"one", b"aaaa", b"bbbb", b"cc"]

    peer.sendto(b"direct again", own.getsockname())
    assert rs.recvfrom(65536) == (b"direct again", there) and not rs.relayed(there)
    rs.sendto(b"straight", there)
    assert peer.recvfrom(100)[0] == b"straight"

    rs.permit("198.51.100.77")
    asked = [a for k, a in sent_to_server() if k == turn.CREATE_PERMISSION]
    assert [a[turn.XOR_PEER_ADDRESS] for a in asked] == [turn.xor_address("198.51.100.77", 0)]
    for s in (server, peer):
        s.close()
    rs.close()
