"""Writes the sanitizer step's seed corpus (``corpus/``), run once by hand when a format changes; the files are
kept in the repository:

    python make_corpus.py

``quic.txt``: datagrams a QUIC endpoint may get from anyone (genuine client Initials for several ALPNs and
id lengths, with a token, coalesced with more; an unknown version; Retry and version negotiation packets;
0-RTT, Handshake and short-header packets of unknown connections; runts). ``dpdk.txt``: erdma-dpdk frames
(Ethernet + the shim's header, ``erdma_dpdk/shim.c``'s ``struct wire``) as a peer's would be, of each type and
with edge values. ``relay.txt``: Ethernet frames for the lab's relay (unicast, broadcast, multicast sources,
runts, jumbo)."""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

HERE = Path(__file__).parent / "corpus"


def quic() -> list[tuple[str, bytes]]:
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection
    from aioquic.quic.packet import encode_quic_retry, encode_quic_version_negotiation

    out = []
    for alpn in ("erdma/1", "h3", "x" * 255):
        conn = QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=[alpn]))
        conn.connect(("10.0.0.2", 2000), now=0.0)
        for i, (data, _) in enumerate(conn.datagrams_to_send(now=0.0)):
            out.append((f"client Initial, ALPN {alpn[:10]!r}, datagram {i}", data))
    first = out[0][1]
    out.append(("an Initial with an unknown version", first[:1] + b"\x1a\x2a\x3a\x4a" + first[5:]))
    out.append(("an Initial coalesced with garbage", first + os.urandom(200)))
    out.append(("Retry", encode_quic_retry(1, os.urandom(8), os.urandom(8), os.urandom(8), os.urandom(60))))
    out.append(("version negotiation", encode_quic_version_negotiation(os.urandom(8), os.urandom(8), [0x1a2a3a4a, 2])))
    for kind, name in ((0xD0, "0-RTT"), (0xE0, "Handshake")):
        body = bytes([kind | 0x03]) + b"\x00\x00\x00\x01" + b"\x08" + os.urandom(8) + b"\x08" + os.urandom(8)
        out.append((f"{name} of an unknown connection", body + b"\x44\x00" + os.urandom(1200)))
    out.append(("short header, unknown id", bytes([0x41]) + os.urandom(60)))
    out.append(("a runt: one byte", b"\xc0"))
    out.append(("a runt: a long header cut in its ids", first[:9]))
    out.append(("zero-length ids", bytes([0xC3]) + b"\x00\x00\x00\x01\x00\x00" + os.urandom(1200)))
    out.append(("a 20-byte destination id", bytes([0xC3]) + b"\x00\x00\x00\x01\x14" + os.urandom(20) + b"\x00"
                + b"\x00\x44\xd0" + os.urandom(1200)))
    return out


ETHER = 0x88B5  # erdma_dpdk/shim.c: ETHER_TYPE
WIRE = struct.Struct("<6s6sHIBBHIIIIIIQ")  # see dpdk_frames.py for the layout


def dpdk() -> list[tuple[str, bytes]]:
    from dpdk_frames import frame

    rng = random.Random(5)
    out = []
    for type_, name in ((1, "data"), (2, "ack"), (3, "probe"), (0, "type 0"), (255, "type 255")):
        out.append((f"{name}, in order", frame(type_=type_, psn=0, payload=os.urandom(64) if type_ == 1 else b"")))
    out.append(("data, far ahead of the window", frame(type_=1, psn=1 << 31, payload=os.urandom(100))))
    out.append(("data, len larger than the frame", frame(type_=1, psn=0, payload=b"", length=60000)))
    out.append(("ack with a full sack bitmap", frame(type_=2, ack=5, sack=(1 << 64) - 1, window=0)))
    out.append(("ack of what was never sent", frame(type_=2, ack=1 << 30, sack=rng.getrandbits(64))))
    out.append(("a header cut short", frame(type_=1, psn=0, payload=b"")[:20]))
    out.append(("another job", frame(type_=1, psn=0, payload=b"x", job=0xDEAD)))
    out.append(("a wrong nonce", frame(type_=1, psn=0, payload=b"x", nonce=1)))
    out.append(("a source rank out of range", frame(type_=1, psn=0, payload=b"x", src=60000)))
    return out


def relay() -> list[tuple[str, bytes]]:
    rng = random.Random(7)
    out = []
    a, b = bytes.fromhex("020000000001"), bytes.fromhex("020000000002")
    out.append(("unicast a -> b", b + a + b"\x08\x00" + rng.randbytes(60)))
    out.append(("unicast b -> a", a + b + b"\x08\x00" + rng.randbytes(60)))
    out.append(("broadcast", b"\xff" * 6 + a + b"\x08\x06" + rng.randbytes(28)))
    out.append(("multicast source", b + bytes.fromhex("010000000001") + b"\x08\x00" + rng.randbytes(40)))
    out.append(("a runt: 13 bytes", b + a + b"\x08"))
    out.append(("exactly a header", b + a + b"\x08\x00"))
    out.append(("jumbo", b + a + b"\x08\x00" + rng.randbytes(9000)))
    return out


def write(name: str, items: list[tuple[str, bytes]]) -> None:
    lines = [f"# {name}: written by make_corpus.py (one input a line, hex)"]
    for what, data in items:
        lines += [f"# {what}", data.hex()]
    (HERE / name).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    HERE.mkdir(exist_ok=True)
    write("quic.txt", quic())
    write("dpdk.txt", dpdk())
    write("relay.txt", relay())
