"""QUIC engines side by side through a lab link: aioquic (the plugin's engine, with its cubic/reno or the
plugin's model-based "bbr") against qh3 (an aioquic fork whose transport core is compiled Rust, congestion
control built in). One connection, one stream, SIZE bytes one way, sans-IO on a plain UDP socket: the engines'
own cost and their congestion control, without eRDMA's transport around them. Prints MB/s and the CPU-seconds
of each side. Needs root (network namespaces), erdma-quic and, for qh3, ``pip install qh3``.

    python -m benchmarks.quic_engines --scenarios lan,continental,lossy \
        --engines qh3,aioquic:bbr,aioquic:cubic --size 32M --datagram 1452
"""

from __future__ import annotations

import argparse
import importlib
import json
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from erdma_core.cli.bench import parse_size

ROOT = Path(__file__).resolve().parents[1]
PORT = 9400


def modules(engine: str) -> tuple[ModuleType, ModuleType, ModuleType]:
    if engine not in ("aioquic", "qh3"):
        raise SystemExit(f"engine={engine!r}: valid choices are aioquic, qh3")
    return tuple(importlib.import_module(f"{engine}.quic.{m}")  # type: ignore[return-value]
                 for m in ("configuration", "connection", "events"))


def configs(engine: str, cc: str, datagram: int, window: int) -> tuple[Any, Any]:
    """Client and server configurations with a CA derived from a fixed secret; the client verifies the server."""
    from cryptography.hazmat.primitives import serialization as ser
    from erdma_quic import credentials as cred
    cfgm, _, _ = modules(engine)
    ca = cred.derived_authority(b"benchmarks.quic_engines", 1)  # both processes derive the same CA
    creds = cred.issue(ca, 0, 1)
    limits: dict[str, Any] = {"max_datagram_size": datagram, "max_data": window, "max_stream_data": window}
    if engine == "aioquic":
        if cc == "bbr":
            import erdma_quic.congestion  # noqa: F401  registers "bbr" with aioquic
        if cc:
            limits["congestion_control_algorithm"] = cc
    elif cc:
        raise SystemExit(f"qh3's congestion control is built in; got {engine}:{cc}")
    client = cfgm.QuicConfiguration(is_client=True, alpn_protocols=["bench"], server_name=creds.name, **limits)
    client.cadata = ca.pem
    server = cfgm.QuicConfiguration(is_client=False, alpn_protocols=["bench"], **limits)
    d = Path(tempfile.mkdtemp())
    (d / "c.pem").write_bytes(creds.cert.public_bytes(ser.Encoding.PEM))
    (d / "k.pem").write_bytes(creds.key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8,
                                                      ser.NoEncryption()))
    server.load_cert_chain(str(d / "c.pem"), str(d / "k.pem"))
    return client, server


def peer(role: str, engine: str, cc: str, host: str, size: int, datagram: int, timeout: float) -> dict[str, Any]:
    """One side: the client sends ``size`` bytes on one stream, the server receives them."""
    _, conm, ev = modules(engine)
    ccfg, scfg = configs(engine, cc, datagram, 2 * size)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
    deadline = time.monotonic() + timeout
    if role == "server":
        sock.bind(("0.0.0.0", PORT))
        print("ready", flush=True)
        sock.settimeout(timeout)
        first, addr = sock.recvfrom(65536)
        conn = conm.QuicConnection(configuration=scfg, original_destination_connection_id=first[6:6 + first[5]])
        conn.receive_datagram(first, addr, now=time.monotonic())
    else:
        conn = conm.QuicConnection(configuration=ccfg)
        conn.connect((host, PORT), now=time.monotonic())
    sock.setblocking(False)
    cpu0, got, t0, result = time.process_time(), 0, 0.0, None
    while result is None:
        now = time.monotonic()
        if now > deadline:
            raise SystemExit(f"{role}: {got} of {size} bytes after {timeout} s")
        for data, a in conn.datagrams_to_send(now=now):
            try:
                sock.sendto(data, a)
            except BlockingIOError:
                pass
        while (e := conn.next_event()) is not None:
            if isinstance(e, ev.HandshakeCompleted) and role == "client":
                t0 = time.monotonic()
                conn.send_stream_data(conn.get_next_available_stream_id(is_unidirectional=True), bytes(size),
                                      end_stream=True)
            elif isinstance(e, ev.StreamDataReceived):
                t0 = t0 or time.monotonic()
                got += len(e.data)
                if e.end_stream:
                    result = {"bytes": got, "seconds": time.monotonic() - t0}
                    conn.close()
            elif isinstance(e, ev.ConnectionTerminated):
                result = {"closed": e.reason_phrase}
        at = conn.get_timer()
        wait = 0.05 if at is None else min(0.05, max(0.0, at - time.monotonic()))
        if select.select([sock], [], [], wait)[0]:
            while True:
                try:
                    data, a = sock.recvfrom(65536)
                except BlockingIOError:
                    break
                conn.receive_datagram(data, a, now=time.monotonic())
        at = conn.get_timer()
        if at is not None and at <= time.monotonic():
            conn.handle_timer(now=time.monotonic())
    for data, a in conn.datagrams_to_send(now=time.monotonic()):
        sock.sendto(data, a)
    result["cpu_s"] = time.process_time() - cpu0
    return result


def through(scenario: str, runs: list[str], size: int, datagram: int, timeout: float) -> list[dict[str, Any]]:
    from benchmarks.netlab.topology import Lab
    from benchmarks.scenarios import scenario as spec_of

    spec = spec_of(scenario)
    if spec is None:
        raise SystemExit(f"scenario={scenario!r} has no emulated link")
    rows = []
    with Lab(2, spec) as lab:
        for run in runs:
            engine, _, cc = run.partition(":")
            argv = [sys.executable, "-m", "benchmarks.quic_engines", "peer", "--engine", engine, "--cc", cc,
                    "--size", str(size), "--datagram", str(datagram), "--timeout", str(timeout)]
            srv = lab.popen(1, [*argv, "--role", "server"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
            assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
            cli = lab.popen(0, [*argv, "--role", "client", "--host", lab.addr(1)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
            got = json.loads(srv.communicate(timeout=timeout + 30)[0])
            sent = json.loads(cli.communicate(timeout=30)[0])
            rows.append({"scenario": scenario, "run": run, **got, "sender_cpu_s": sent["cpu_s"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="lab", choices=["lab", "peer"])
    ap.add_argument("--scenarios", default="lan,continental,lossy")
    ap.add_argument("--engines", default="qh3,aioquic:bbr,aioquic:cubic", help="engine[:controller], ...")
    ap.add_argument("--size", default="32M")
    ap.add_argument("--datagram", type=int, default=1452)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--role", choices=["client", "server"])
    ap.add_argument("--engine", default="aioquic")
    ap.add_argument("--cc", default="")
    ap.add_argument("--host", default="")
    args = ap.parse_args()
    size = parse_size(args.size)
    if args.mode == "peer":
        print(json.dumps(peer(args.role, args.engine, args.cc, args.host, size, args.datagram, args.timeout)))
        return
    print(f"{'scenario':<12} {'engine':<14} {'MB/s':>8} {'Mbit/s':>8} {'sender CPU-s':>13} {'receiver CPU-s':>15}")
    for name in args.scenarios.split(","):
        for r in through(name, args.engines.split(","), size, args.datagram, args.timeout):
            if "seconds" not in r:
                print(f"{name:<12} {r['run']:<14} connection closed: {r.get('closed')}")
                continue
            mbs = r["bytes"] / r["seconds"] / 1e6
            print(f"{name:<12} {r['run']:<14} {mbs:>8.2f} {mbs * 8:>8.1f} {r['sender_cpu_s']:>13.2f} "
                  f"{r['cpu_s']:>15.2f}", flush=True)


if __name__ == "__main__":
    main()
