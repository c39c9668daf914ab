"""Ping-like probes through the lab: a UDP echo server and a client that counts round trips, losses and
reorderings, and a TCP bulk sender/sink for throughput.

    python -m benchmarks.netlab.probe echo --port 9000
    python -m benchmarks.netlab.probe ping --host 10.77.5.2 --port 9000 --count 1000 --interval-ms 2
    python -m benchmarks.netlab.probe sink --port 9001
    python -m benchmarks.netlab.probe send --host 10.77.5.2 --port 9001 --seconds 3

The clients print one JSON line. Servers exit after ``--idle`` seconds without traffic.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import statistics
import struct
import sys
import time

_PROBE = struct.Struct("!Id")  # sequence number, send time


def echo(port: int, idle: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    s.settimeout(idle)
    print("ready", flush=True)
    try:
        while True:
            data, peer = s.recvfrom(2048)
            s.sendto(data, peer)
    except TimeoutError:
        pass


def ping(host: str, port: int, count: int, interval: float, wait: float, size: int) -> dict[str, object]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    rtts: dict[int, float] = {}
    arrival: list[int] = []
    pad = b"\0" * max(0, size - _PROBE.size)
    start = time.monotonic()
    sent = 0
    end = None
    while True:
        now = time.monotonic()
        if sent < count and now >= start + sent * interval:
            s.sendto(_PROBE.pack(sent, now) + pad, (host, port))
            sent += 1
            continue
        if sent == count and end is None:
            end = now + wait
        if end is not None and now >= end:
            break
        next_send = start + sent * interval if sent < count else end
        ready, _, _ = select.select([s], [], [], max(0.0, (next_send or now) - now))
        if ready:
            data = s.recv(2048)
            seq, t0 = _PROBE.unpack_from(data)
            if seq not in rtts:
                rtts[seq] = (time.monotonic() - t0) * 1e3
                arrival.append(seq)
    reordered, highest = 0, -1
    for q in arrival:  # a reply overtaken by a later-sent one
        reordered += q < highest
        highest = max(highest, q)
    vals = sorted(rtts.values())
    return {"sent": sent, "received": len(rtts), "lost": sent - len(rtts), "reordered": reordered,
            "rtt_min_ms": vals[0] if vals else None, "rtt_median_ms": statistics.median(vals) if vals else None,
            "rtt_max_ms": vals[-1] if vals else None}


def sink(port: int, idle: float) -> None:
    srv = socket.create_server(("0.0.0.0", port))
    srv.settimeout(idle)
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    while conn.recv_into(buf):
        pass
    conn.close()


def send(host: str, port: int, seconds: float) -> dict[str, object]:
    c = socket.create_connection((host, port), timeout=30)
    cc = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
    chunk = b"\0" * (1 << 16)
    sent = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        sent += c.send(chunk)
    c.shutdown(socket.SHUT_WR)
    c.recv(1)  # the sink closes after reading everything: the time covers delivery, not just buffering
    took = time.monotonic() - start
    c.close()
    return {"bytes": sent, "seconds": took, "mbit_s": sent * 8 / took / 1e6, "congestion_control": cc}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.netlab.probe")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("echo", "sink"):
        p = sub.add_parser(name)
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--idle", type=float, default=30.0)
    p = sub.add_parser("ping")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--interval-ms", type=float, default=10.0)
    p.add_argument("--wait", type=float, default=1.0, help="seconds to wait for late replies")
    p.add_argument("--size", type=int, default=64)
    p = sub.add_parser("send")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args(argv)
    if a.cmd == "echo":
        echo(a.port, a.idle)
    elif a.cmd == "sink":
        sink(a.port, a.idle)
    elif a.cmd == "ping":
        print(json.dumps(ping(a.host, a.port, a.count, a.interval_ms / 1e3, a.wait, a.size)))
    else:
        print(json.dumps(send(a.host, a.port, a.seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
