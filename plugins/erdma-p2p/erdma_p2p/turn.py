"""A TURN client (RFC 8656, UDP, long-term credentials) as a sans-IO state machine: one allocation on a relay
server, permissions for the peers' addresses, channels to them, and the framing of data both ways.

Time is an argument and what to send is returned as data: ``start``, ``on_timer``, ``wrap`` and ``on_datagram``
queue requests, which ``outgoing()`` hands to the I/O adapter (``relayed.py``) for the server. Requests are
resent at RTO, 2 RTO, ... like STUN's; a 401 (or a 438 stale nonce) is answered once with the credentials
and the server's realm and nonce. The allocation, the permissions and the channels are refreshed before they
expire (at half their lifetime, permissions every 4 minutes), and a Binding indication goes to the server when
nothing else has for 15 s, so that a NAT on the way keeps its binding of this socket to the server.

Data for a peer leaves as ChannelData once its channel is bound (4 bytes of framing), as a Send indication
before; data from a peer arrives either way and is handed back with the peer's address. Responses are
checked (transaction id, integrity under the session key) before they change anything; other datagrams
from the server are dropped.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import struct

from .stun import MAGIC, Mapped, StunError, address, attributes

BINDING, ALLOCATE, REFRESH, SEND, DATA_IND, CREATE_PERMISSION, CHANNEL_BIND = 0x001, 0x003, 0x004, 0x006, 0x007, 0x008, 0x009
REQUEST, INDICATION, SUCCESS, ERROR = 0x0000, 0x0010, 0x0100, 0x0110
USERNAME, MESSAGE_INTEGRITY, ERROR_CODE = 0x0006, 0x0008, 0x0009
CHANNEL_NUMBER, LIFETIME, XOR_PEER_ADDRESS, DATA = 0x000C, 0x000D, 0x0012, 0x0013
REALM, NONCE, XOR_RELAYED_ADDRESS, REQUESTED_TRANSPORT, XOR_MAPPED_ADDRESS = 0x0014, 0x0015, 0x0016, 0x0019, 0x0020
_HEADER = struct.Struct("!HHI12s")
FIRST_CHANNEL, LAST_CHANNEL = 0x4000, 0x4FFF
PERMISSION_REFRESH = 240.0  # seconds; a permission lasts 300
# seconds without a datagram to the server before a Binding indication goes to it: a NAT forgets an idle UDP
# binding (Linux's conntrack after 30 s), and behind a NAT that maps each destination anew the next datagram
# then leaves from another port, which the server no longer knows as the allocation's (ICE's keepalive, RFC 8445
# section 11, is 15 s)
KEEPALIVE_S = 15.0
MAX_DATAGRAM = 65535


class TurnError(StunError):
    """The relay refused a request (its error code and reason), or never answered."""


Peer = Mapped  # a peer's address, as the relay sees it


def xor_address(host: str, port: int) -> bytes:
    """An XOR-*-ADDRESS attribute's value (IPv4)."""
    raw = bytes(a ^ b for a, b in zip(ipaddress.IPv4Address(host).packed, struct.pack("!I", MAGIC), strict=True))
    return struct.pack("!BBH", 0, 1, port ^ (MAGIC >> 16)) + raw


def _attr(kind: int, value: bytes) -> bytes:
    return struct.pack("!HH", kind, len(value)) + value + b"\0" * (-len(value) % 4)


def message(kind: int, txid: bytes, attrs: bytes, key: bytes | None = None) -> bytes:
    """A STUN message; with ``key``, MESSAGE-INTEGRITY (HMAC-SHA1) over it is appended."""
    if key is None:
        return _HEADER.pack(kind, len(attrs), MAGIC, txid) + attrs
    head = _HEADER.pack(kind, len(attrs) + 24, MAGIC, txid)
    mac = hmac.new(key, head + attrs, hashlib.sha1).digest()
    return head + attrs + _attr(MESSAGE_INTEGRITY, mac)


def integrity_ok(data: bytes, key: bytes) -> bool:
    """Whether ``data`` (a whole STUN message) carries a MESSAGE-INTEGRITY that verifies under ``key``."""
    pos = 20
    while pos + 4 <= len(data):
        kind, length = struct.unpack_from("!HH", data, pos)
        if kind == MESSAGE_INTEGRITY:
            if length != 20 or pos + 24 > len(data):
                return False
            head = struct.pack("!H", pos + 24 - 20)
            covered = data[:2] + head + data[4:pos]
            return hmac.compare_digest(hmac.new(key, covered, hashlib.sha1).digest(), data[pos + 4:pos + 24])
        pos += 4 + length + (-length % 4)
    return False


def channel_data(channel: int, payload: bytes | memoryview) -> bytes:
    return struct.pack("!HH", channel, len(payload)) + bytes(payload)


class _Txn:
    __slots__ = ("attrs", "authed", "method", "next_at", "peer", "sends_left", "txid", "wait")

    def __init__(self, method: int, attrs: bytes, peer: Peer | None, now: float, rto: float, sends: int) -> None:
        self.method, self.attrs, self.peer = method, attrs, peer
        self.txid = os.urandom(12)
        self.sends_left, self.wait, self.next_at = sends, rto, now
        self.authed = False


class TurnClient:
    """One allocation on ``server`` for ``username``/``password`` (long-term credentials)."""

    def __init__(self, username: str, password: str, rto: float = 0.5, sends: int = 7, lifetime: int = 600) -> None:
        self.username, self.password = username, password
        self.rto, self.sends, self.lifetime = rto, sends, lifetime
        self.realm = b""
        self.nonce = b""
        self.key: bytes | None = None
        self.relayed: Mapped | None = None  # the allocation's relayed address: what peers send to
        self.mapped: Mapped | None = None  # this socket's address as the server saw it
        self.error: TurnError | None = None  # the allocation failed or was lost
        self.denied: dict[str, str] = {}  # peer host -> why the server refused a permission for it
        self._txns: dict[bytes, _Txn] = {}
        self._out: list[bytes] = []
        self._expires = 0.0  # when the allocation is refreshed
        self.last_sent = 0.0  # when a datagram last left for the server (a request, data, a keepalive)
        self._ends = 0.0  # when it ends unless refreshed
        self._permitted: dict[str, float] = {}  # peer host -> when its permission was last asked for
        self._channels: dict[Peer, int] = {}  # asked or bound
        self._bound: dict[Peer, float] = {}  # bound: when to refresh
        self._by_channel: dict[int, Peer] = {}
        self._seen: set[Peer] = set()  # peers heard from by Data indication
        self._next_channel = FIRST_CHANNEL

    # ---- driving --------------------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """Ask for the allocation (its answer sets ``relayed`` or ``error``)."""
        self._request(ALLOCATE, _attr(REQUESTED_TRANSPORT, bytes([17, 0, 0, 0])) +
                      _attr(LIFETIME, struct.pack("!I", self.lifetime)), None, now)

    def usable_until(self, now: float) -> float:
        """When the allocation ends unless refreshed before (``now`` when it failed or never came)."""
        return now if self.error is not None or self.relayed is None else self._ends

    def outgoing(self) -> list[bytes]:
        """Datagrams for the server, queued since the last call."""
        out, self._out = self._out, []
        return out

    @property
    def timer(self) -> float | None:
        """When ``on_timer`` has something to do next."""
        times = [t.next_at for t in self._txns.values()]
        if self.relayed is not None:
            times += [self._expires, self.last_sent + KEEPALIVE_S]
            times += [t + PERMISSION_REFRESH for t in self._permitted.values()]
            times += list(self._bound.values())
        return min(times) if times else None

    def on_timer(self, now: float) -> None:
        for txn in list(self._txns.values()):
            if now < txn.next_at:
                continue
            if txn.sends_left == 0:
                del self._txns[txn.txid]
                self._failed(txn, TurnError(f"no answer from the TURN server to {_NAMES[txn.method]}"))
                continue
            self._send(txn, now)
        if self.relayed is None or self.error is not None:
            return
        if now >= self._expires:
            self._expires = now + self.lifetime  # asked for; the answer sets the real one
            self._request(REFRESH, _attr(LIFETIME, struct.pack("!I", self.lifetime)), None, now)
        for host, asked in list(self._permitted.items()):
            if now >= asked + PERMISSION_REFRESH:
                self._permit(host, now)
        for peer, at in list(self._bound.items()):
            if now >= at:
                self._bound[peer] = now + self.lifetime
                self._bind(peer, self._channels[peer], now)
        if now >= self.last_sent + KEEPALIVE_S:  # (nothing else went)
            self._out.append(message(BINDING | INDICATION, os.urandom(12), b""))
            self.last_sent = now

    def close(self, now: float) -> None:
        """Release the allocation (a Refresh with lifetime 0; best effort, nothing waits for it)."""
        if self.relayed is not None and self.key is not None:
            txn = _Txn(REFRESH, _attr(LIFETIME, struct.pack("!I", 0)), None, now, self.rto, 1)
            self._out.append(self._encode(txn))
        self.relayed = None
        self._txns.clear()

    def peers(self) -> list[Peer]:
        """The peers data has been sent to or has come from through the relay."""
        return list(self._channels) + [p for p in self._seen if p not in self._channels]

    def permit(self, host: str, now: float) -> None:
        """Ask for a permission for ``host`` (one peer may then send to the relayed address from any port of
        it) unless it was asked for already; a refusal lands in ``denied``."""
        if host not in self._permitted and self.relayed is not None:
            self._permit(host, now)

    # ---- data ---------------------------------------------------------------------------------------
    def wrap(self, payload: bytes | memoryview, host: str, port: int, now: float) -> bytes:
        """``payload`` for ``host:port`` as the server must receive it: ChannelData on a bound channel, or a
        Send indication (asking for the permission and the channel first, the first time)."""
        peer = Peer(host, port)
        self.last_sent = now
        channel = self._channels.get(peer)
        if channel is not None and peer in self._bound:
            return channel_data(channel, payload)
        if host not in self._permitted:
            self._permit(host, now)
        if channel is None and self._next_channel <= LAST_CHANNEL:
            channel = self._channels[peer] = self._next_channel
            self._next_channel += 1
            self._by_channel[channel] = peer
            self._bind(peer, channel, now)
        return message(SEND | INDICATION, os.urandom(12), _attr(XOR_PEER_ADDRESS, xor_address(host, port)) +
                       _attr(DATA, bytes(payload)))

    def on_datagram(self, data: bytes, now: float) -> tuple[bytes, Peer] | None:
        """A datagram from the server: a peer's data ``(payload, peer)``, or None (a response, or junk)."""
        if len(data) >= 4 and FIRST_CHANNEL <= struct.unpack_from("!H", data)[0] <= LAST_CHANNEL:
            channel, length = struct.unpack_from("!HH", data)
            peer = self._by_channel.get(channel)
            if peer is None or 4 + length > len(data):
                return None
            return data[4:4 + length], peer
        if not 20 <= len(data) <= MAX_DATAGRAM:
            return None
        kind, length, magic, txid = _HEADER.unpack_from(data)
        if magic != MAGIC or length != len(data) - 20 or length % 4:
            return None
        attrs = attributes(data[20:])
        if attrs is None:
            return None
        if kind == DATA_IND | INDICATION:
            addr = address(attrs.get(XOR_PEER_ADDRESS, b""), xor=True)
            if addr is None or DATA not in attrs:
                return None
            if len(self._seen) < 1024:
                self._seen.add(addr)
            return attrs[DATA], addr
        txn = self._txns.get(txid)
        if txn is None or kind & 0x3EEF != txn.method:
            return None
        if kind & 0x0110 == SUCCESS and txn.authed and not integrity_ok(data, self.key or b""):
            return None  # not from the server we share the key with (an error answer to wrong credentials
            # cannot be signed with them; it can only fail the request or give a fresh nonce)
        del self._txns[txid]
        if kind & 0x0110 == ERROR:
            self._on_error(txn, attrs, now)
        elif kind & 0x0110 == SUCCESS:
            self._on_success(txn, attrs, now)
        return None

    # ---- internals ----------------------------------------------------------------------------------
    def _request(self, method: int, attrs: bytes, peer: Peer | None, now: float) -> None:
        txn = _Txn(method, attrs, peer, now, self.rto, self.sends)
        self._txns[txn.txid] = txn
        self._send(txn, now)

    def _send(self, txn: _Txn, now: float) -> None:
        txn.sends_left -= 1
        self.last_sent = now
        txn.next_at = now + txn.wait
        txn.wait *= 2
        self._out.append(self._encode(txn))

    def _encode(self, txn: _Txn) -> bytes:
        if self.key is None:
            return message(txn.method | REQUEST, txn.txid, txn.attrs)
        txn.authed = True
        cred = _attr(USERNAME, self.username.encode()) + _attr(REALM, self.realm) + _attr(NONCE, self.nonce)
        return message(txn.method | REQUEST, txn.txid, txn.attrs + cred, self.key)

    def _permit(self, host: str, now: float) -> None:
        self._permitted[host] = now
        self._request(CREATE_PERMISSION, _attr(XOR_PEER_ADDRESS, xor_address(host, 0)), Peer(host, 0), now)

    def _bind(self, peer: Peer, channel: int, now: float) -> None:
        self._request(CHANNEL_BIND, _attr(CHANNEL_NUMBER, struct.pack("!HH", channel, 0)) +
                      _attr(XOR_PEER_ADDRESS, xor_address(*peer)), peer, now)

    def _on_error(self, txn: _Txn, attrs: dict[int, bytes], now: float) -> None:
        err = attrs.get(ERROR_CODE, b"")
        code = (err[2] & 0x7) * 100 + err[3] if len(err) >= 4 else 0
        reason = err[4:].decode(errors="replace")
        if code in (401, 438) and NONCE in attrs and (not txn.authed or code == 438):
            self.nonce = attrs[NONCE]
            if REALM in attrs:
                self.realm = attrs[REALM]
            self.key = hashlib.md5(f"{self.username}:{self.realm.decode(errors='replace')}:{self.password}".encode(),
                                   usedforsecurity=False).digest()
            self._request(txn.method, txn.attrs, txn.peer, now)
            return
        self._failed(txn, TurnError(f"the TURN server refused {_NAMES[txn.method]}: error {code} {reason}".rstrip()))

    def _failed(self, txn: _Txn, error: TurnError) -> None:
        if txn.method in (ALLOCATE, REFRESH):
            self.error = error
        elif txn.peer is not None:
            self.denied[txn.peer.host] = str(error)

    def _on_success(self, txn: _Txn, attrs: dict[int, bytes], now: float) -> None:
        if txn.method in (ALLOCATE, REFRESH):
            life = attrs.get(LIFETIME, b"")
            seconds = struct.unpack("!I", life)[0] if len(life) == 4 else self.lifetime
            self._expires = now + max(seconds / 2, 1.0)
            self._ends = now + seconds
        if txn.method == ALLOCATE:
            self.relayed = address(attrs.get(XOR_RELAYED_ADDRESS, b""), xor=True)
            self.mapped = address(attrs.get(XOR_MAPPED_ADDRESS, b""), xor=True)
            if self.relayed is None:
                self.error = TurnError("the TURN server's Allocate answer has no IPv4 relayed address")
        elif txn.method == CHANNEL_BIND and txn.peer is not None:
            self._bound[txn.peer] = now + self.lifetime / 2


_NAMES = {ALLOCATE: "Allocate", REFRESH: "Refresh", CREATE_PERMISSION: "CreatePermission",
          CHANNEL_BIND: "ChannelBind"}
