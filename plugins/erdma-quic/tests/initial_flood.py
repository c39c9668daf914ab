"""A stranger that floods a QUIC port with genuine first flights, run as a process of its own:

    python initial_flood.py HOST:PORT --count 10000 --rate 150 --ports 64 [--follow-retry]

Each datagram is a real client Initial (RFC 9000 17.2.2, padded to 1200 bytes, protected with the keys its
own random destination connection id derives) carrying a TLS 1.3 ClientHello for ``--alpn`` and no
certificate: what a scanner or a misconfigured client sends. The ClientHello is made once by aioquic; each
Initial gets a fresh destination connection id, so every one asks the listener for a connection of its own.
They leave from ``--ports`` UDP sockets in turn, at ``--rate`` a second. ``--follow-retry``: an Initial
answered with a Retry is sent again with the Retry's token (what a client with a real address does), so the
flood passes address validation. Prints one JSON line at the end: sent, retries seen, resent, and datagrams
received in all.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import time

from aioquic import tls
from aioquic.buffer import Buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.crypto import CryptoPair
from aioquic.quic.packet import QuicFrameType, QuicPacketType, pull_quic_header
from aioquic.quic.packet_builder import QuicPacketBuilder

VERSION = 0x00000001


def client_hello(alpn: str) -> tuple[bytes, bytes]:
    """A TLS 1.3 ClientHello as aioquic's client writes it for ``alpn``, and the source connection id its
    transport parameters name (every Initial that carries it must come from that id)."""
    conn = QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=[alpn]))
    conn.connect(("127.0.0.1", 9), now=0.0)
    return bytes(conn._crypto_streams[tls.Epoch.INITIAL].sender._buffer), conn.host_cid


def initial(hello: bytes, dcid: bytes, scid: bytes, token: bytes = b"") -> bytes:
    """One padded client Initial carrying ``hello`` in a CRYPTO frame, protected for ``dcid``."""
    crypto = CryptoPair()
    crypto.setup_initial(dcid, is_client=True, version=VERSION)
    builder = QuicPacketBuilder(host_cid=scid, peer_cid=dcid, version=VERSION, is_client=True, max_datagram_size=1200,
                                peer_token=token)
    builder.start_packet(QuicPacketType.INITIAL, crypto)
    buf = builder.start_frame(QuicFrameType.CRYPTO)
    buf.push_uint_var(0)
    buf.push_uint_var(len(hello))
    buf.push_bytes(hello)
    datagrams, _ = builder.flush()
    return datagrams[0]


def retry_token(data: bytes) -> tuple[bytes, bytes] | None:
    """(the Retry's source connection id, its token) if ``data`` is a Retry, else None."""
    try:
        header = pull_quic_header(Buffer(data=data), host_cid_length=8)
    except ValueError:
        return None
    if header.packet_type != QuicPacketType.RETRY:
        return None
    return header.source_cid, header.token


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--count", type=int, default=10000)
    ap.add_argument("--rate", type=float, default=150.0)
    ap.add_argument("--ports", type=int, default=64)
    ap.add_argument("--alpn", default="h3")
    ap.add_argument("--follow-retry", action="store_true")
    args = ap.parse_args()
    host, port = args.target.rsplit(":", 1)
    target = (host, int(port))
    hello, scid = client_hello(args.alpn)
    socks = []
    sel = selectors.DefaultSelector()
    for _ in range(args.ports):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1" if host.startswith("127.") else "0.0.0.0", 0))
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        socks.append(s)
    sent = retries = resent = received = 0
    start = time.monotonic()
    finish = None
    while finish is None or time.monotonic() < finish:
        now = time.monotonic()
        if sent < args.count and now >= start + sent / args.rate:
            try:
                socks[sent % len(socks)].sendto(initial(hello, os.urandom(8), scid), target)
            except OSError:
                pass
            sent += 1
            if sent == args.count:
                finish = time.monotonic() + 1.0  # the last answers
            continue
        wake = finish if finish is not None else start + sent / args.rate
        for key, _ in sel.select(max(0.0, min(wake - now, 0.05))):
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                data = sock.recv(65536)
            except OSError:
                continue
            received += 1
            got = retry_token(data)
            if got is None:
                continue
            retries += 1
            if args.follow_retry:
                sock.sendto(initial(hello, got[0], scid, got[1]), target)
                resent += 1
    print(json.dumps({"sent": sent, "retries": retries, "resent": resent, "received": received,
                      "seconds": round(time.monotonic() - start, 2)}), flush=True)


if __name__ == "__main__":
    main()
