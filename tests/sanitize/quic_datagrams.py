"""erdma-quic's ngtcp2 shim, built with AddressSanitizer and UBSan (``build.py``), fed malformed input:

    LD_PRELOAD=$(cc -print-file-name=libasan.so) python quic_datagrams.py BUILT CORPUS [--mutations N] [--seed S]

* every datagram of the corpus (``corpus/quic.txt``: genuine Initials for several ALPNs, a Retry token's
  Initial, version negotiation, short headers, runts, garbage) and ``N`` mutations of each (bits flipped, cut,
  grown, bytes spliced from another, length fields set to their extremes) as a stranger's first datagram
  (``eq_accept``), then a few more mutated ones into the connection it opened, its timers and its output;
* the same as a listener's answers to a dialling connection (Retry, version negotiation, Initial);
* a genuine session ticket and its mutations, resumed with (``tickets_unpack``);
* a genuine connection pair's traffic (messages of every size, placed and whole, loss) with mutated datagrams
  of a live connection's ids read through the receive fast path (``eq_demux_recv``).

A sanitizer that finds a fault stops the process (``halt_on_error``) with its report: exit status not 0.
Prints one line of counts at the end."""

from __future__ import annotations

import random
import socket
from typing import Any

import attrs
from mutate import arguments, corpus, load, mutations


def main() -> None:
    args = arguments()
    load(args.built, "erdma_quic.ngtcp2._shim")
    from cryptography.hazmat.primitives import serialization
    from erdma_quic import credentials
    from erdma_quic.ngtcp2 import connection as C

    C.require()
    ca = credentials.new_authority()

    def config(rank: int, **kw: Any) -> C.Config:
        mine = credentials.issue(ca, rank, 7)
        key = mine.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
        return C.Config(cert_pem=mine.cert.public_bytes(serialization.Encoding.PEM), key_pem=key, ca_pem=ca.pem,
                        check_client=False, head=64, place_from=4096, **kw)  # type: ignore[arg-type]

    rng = random.Random(args.seed)
    seeds = corpus(args.corpus / "quic.txt")
    tickets = C.Tickets()
    listener_cfg = config(0, tickets=tickets, idle_timeout=2.0, handshake_timeout=2.0)
    dialler_cfg = config(1, server_name=credentials.identity(ca.names_key, 0, 7), idle_timeout=2.0)
    here, there = ("10.0.0.2", 2000), ("10.0.0.1", 1000)
    counts = {"accepted": 0, "refused": 0, "fed": 0, "answers": 0, "tickets": 0, "demuxed": 0}
    now = 1.0

    def exercise(conn: Any, extra: list[bytes]) -> None:
        nonlocal now
        for data in extra:
            now += 0.001
            conn.receive_datagram(data, now)
            counts["fed"] += 1
            conn.batches(now)
            due = conn.get_timer()
            if due is not None:
                conn.handle_timer(max(now, due))
            while conn.next_event() is not None:
                pass
        conn.close(0, "done", now)
        conn.batches(now)
        conn.free()

    # a stranger's first datagrams, and what follows them
    for seed in seeds:
        for data in [seed, *mutations(rng, seed, seeds, args.mutations)]:
            now += 0.01
            try:
                conn = C.Connection.accept(listener_cfg, here, there, data, now)
            except ConnectionError:
                counts["refused"] += 1
                continue
            counts["accepted"] += 1
            exercise(conn, mutations(rng, data, seeds, 4))

    # a listener's answers to a dialler
    for seed in seeds:
        conn = C.Connection.dial(dialler_cfg, there, here, now)
        conn.batches(now)
        answers = [seed, *mutations(rng, seed, seeds, args.mutations)]
        counts["answers"] += len(answers)
        exercise(conn, answers)

    # a genuine pair: a ticket, traffic of every size, mutated datagrams through the receive fast path
    a, b, ticket = pair(C, dialler_cfg, listener_cfg, rng)
    # (only our own header of it: the rest is GnuTLS's session data, which the dialler packed itself and which
    # GnuTLS does not parse as if it came from a stranger; a ticket never comes off the wire in this form)
    head = 4 + 8 * 8  # tickets.c: the magic, then eight transport parameters
    variants = [m[:head] + ticket[head:] for m in mutations(rng, ticket[:head], [ticket[:head]], args.mutations * 4)
                if len(m) >= head]
    for data in [ticket, *variants, ticket[:head], ticket[:3]]:
        counts["tickets"] += 1
        try:
            conn = C.Connection.dial(attrs.evolve(dialler_cfg, ticket=data), there, here, now)
        except ConnectionError:
            continue
        exercise(conn, [])
    counts["demuxed"] = demuxed(C, b, rng, seeds, args.mutations)
    a.free()
    b.free()
    print("sanitize: quic:", ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)


def pair(C: Any, dialler_cfg: Any, listener_cfg: Any, rng: random.Random) -> tuple[Any, Any, bytes]:
    """A dialler and a listener through a handshake, a session ticket the listener gave, and messages of
    every size (heads first above 4096 bytes) from the dialler, some datagrams lost on the way."""
    demux = C.Demux()
    listener_cfg = attrs.evolve(listener_cfg, demux=demux, token=7)
    here, there, now = ("10.0.0.2", 2000), ("10.0.0.1", 1000), 1.0
    a = C.Connection.dial(dialler_cfg, there, here, now)
    first = a.datagrams_to_send(now)
    b = C.Connection.accept(listener_cfg, here, there, first[0], now)
    b.receive(first[1:], now)
    ticket = None
    sizes = [0, 1, 63, 64, 65, 4095, 4096, 70000, 1 << 20]
    for n in sizes:
        a.send((bytes(rng.getrandbits(8) for _ in range(64)) * (n // 64 + 1))[:n])
    acked = landed = 0
    for _ in range(100000):
        now += 0.001
        for x, y in ((a, b), (b, a)):
            due = x.get_timer()
            if due is not None and due <= now:
                x.handle_timer(now)
            y.receive([d for d in x.datagrams_to_send(now) if rng.random() > 0.02], now)
        for conn in (a, b):
            while (ev := conn.next_event()) is not None:
                if isinstance(ev, C.Ticket):
                    ticket = ev.data
                acked += isinstance(ev, C.Acked)
                landed += isinstance(ev, C.Message | C.Head)
        if ticket is not None and acked == len(sizes) and landed >= len(sizes):
            break
    assert ticket is not None and acked == len(sizes), f"no session ticket, or {acked} of {len(sizes)} acknowledged"
    b._demux_keep = demux  # type: ignore[attr-defined]
    return a, b, ticket


def demuxed(C: Any, b: Any, rng: random.Random, seeds: list[bytes], n: int) -> int:
    """Mutated short-header datagrams carrying ``b``'s own connection ids, read through its endpoint's
    receive fast path from a UDP socket (what the fast path hands the connection, in C)."""
    demux = b._demux_keep
    ids = b.connection_ids()
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    sent = 0
    try:
        for cid in ids:
            base = bytes([0x40 | rng.getrandbits(5)]) + cid + bytes(rng.getrandbits(8) for _ in range(40))
            for data in [base, *mutations(rng, base, seeds, n)]:
                if not data:
                    continue
                tx.sendto(data[:65000], rx.getsockname())
                sent += 1
                if sent % 32 == 0:
                    demux.receive(rx.fileno(), 2.0)
        while demux.receive(rx.fileno(), 2.0)[0] > 0:
            pass
    finally:
        rx.close()
        tx.close()
    return sent


if __name__ == "__main__":
    main()
