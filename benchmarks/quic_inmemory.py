"""A QUIC engine's CPU cost with no sockets: two sans-IO connections handed each other's datagrams in memory,
one-way SIZE bytes split over streams of STREAM bytes, all opened at once, virtual time 0.5 ms a turn. Prints
MB per CPU-second of the sender and of the receiver. Engines: aioquic (needs erdma-quic installed), qh3
(``pip install qh3``), and the compiled candidates of erdma-quic's engine bake-off, built here from
plugins/erdma-quic/benchmarks/bakeoff: ngtcp2 (C, GnuTLS; ``apt-get install libngtcp2-crypto-gnutls-dev``)
and quinn (quinn-proto, rustls; ``apt-get install cargo librust-quinn-dev``, built offline from Debian's
crates). ``erdma-ngtcp2`` is erdma-quic's own compiled engine (ngtcp2 behind its C shim) driven through its
Python surface (``erdma_quic.ngtcp2.connection``): whole messages in and out, datagrams in batches, so the
cost of Python's side is in the numbers. ``--cc`` picks the compiled engines' congestion controller
(aioquic's is its own default).

    python -m benchmarks.quic_inmemory --datagram 1452 --streams 1M,16M,64M [--engines aioquic,ngtcp2,quinn]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

from erdma_core.cli.bench import parse_size

BAKEOFF = Path(__file__).resolve().parents[1] / "plugins" / "erdma-quic" / "benchmarks" / "bakeoff"


@cache
def _built() -> Path:
    """A folder for the compiled harnesses and a certificate (self-signed, EC P-256, SAN "erdma", not a CA)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    where = Path(tempfile.mkdtemp(prefix="erdma-bakeoff-"))
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "erdma")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("erdma")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (where / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (where / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    return where


@cache
def _binary(engine: str) -> Path:
    """The compiled harness of ``engine`` (ngtcp2, quinn), built now; SystemExit saying what to install."""
    where = _built()
    if engine == "ngtcp2":
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "libngtcp2", "libngtcp2_crypto_gnutls", "gnutls"],
                               capture_output=True, text=True)
        if flags.returncode:
            raise SystemExit("engine ngtcp2: apt-get install libngtcp2-crypto-gnutls-dev libgnutls28-dev pkg-config "
                             f"({flags.stderr.strip()})")
        out = where / "ngtcp2_inmemory"
        subprocess.run(["gcc", "-O2", "-o", str(out), str(BAKEOFF / "ngtcp2_inmemory.c"), *flags.stdout.split()],
                       check=True)
        return out
    cargo = shutil.which("cargo", path="/usr/bin") or shutil.which("cargo")
    if cargo is None:
        raise SystemExit("engine quinn: apt-get install cargo librust-quinn-dev (Debian's crates, built offline)")
    subprocess.run([cargo, "build", "-q", "--release", "--target-dir", str(where / "target")],
                   cwd=BAKEOFF / "quinn_inmemory", check=True, env=os.environ | {"CARGO_NET_OFFLINE": "true"})
    return where / "target" / "release" / "quinn_inmemory"


def run_compiled(engine: str, datagram: int, size: int, stream: int, cc: str) -> tuple[float, float]:
    """Sender and receiver MB per CPU-second of a compiled harness (same workload as ``run``)."""
    where = _built()
    out = subprocess.run([str(_binary(engine)), str(where / "cert.pem"), str(where / "key.pem"), str(datagram),
                          str(size), str(stream), cc], capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"engine {engine}: {out.stderr.strip()}")
    snd, rcv = out.stdout.split()
    return float(snd), float(rcv)


def run(datagram: int, size: int, stream: int, engine: str = "aioquic") -> tuple[float, float]:
    from benchmarks.quic_engines import configs, modules

    _, conm, events = modules(engine)
    ccfg, scfg = configs(engine, "", datagram, 4 * size)
    ccfg.max_stream_data = scfg.max_stream_data = 2 * stream
    client = conm.QuicConnection(configuration=ccfg)
    server = conm.QuicConnection(configuration=scfg,
                                 original_destination_connection_id=client.original_destination_connection_id)
    now, got, sent, cpu_send, cpu_recv = 0.0, 0, False, 0.0, 0.0
    client.connect(("10.0.0.1", 1), now=now)
    chunk = b"x" * stream
    while got < size:
        now += 0.0005
        a = time.process_time()
        out = client.datagrams_to_send(now=now)
        b = time.process_time()
        for data, _ in out:
            server.receive_datagram(data, ("10.0.0.2", 2), now=now)
        while (ev := server.next_event()) is not None:
            if isinstance(ev, events.StreamDataReceived):
                got += len(ev.data)
        back = server.datagrams_to_send(now=now)
        c = time.process_time()
        for data, _ in back:
            client.receive_datagram(data, ("10.0.0.1", 1), now=now)
        while (ev := client.next_event()) is not None:
            if isinstance(ev, events.HandshakeCompleted) and not sent:
                for _ in range(size // stream):
                    sid = client.get_next_available_stream_id(is_unidirectional=True)
                    client.send_stream_data(sid, chunk, end_stream=True)
                sent = True
        d = time.process_time()
        cpu_send += (b - a) + (d - c)
        cpu_recv += c - b
    mb = size / 1e6
    return mb / cpu_send, mb / cpu_recv


def run_engine(datagram: int, size: int, stream: int, cc: str) -> tuple[float, float]:
    """The same workload on erdma-quic's compiled engine, through ``erdma_quic.ngtcp2.connection``."""
    from cryptography.hazmat.primitives import serialization
    from erdma_quic import credentials
    from erdma_quic.ngtcp2.connection import Config, Connection, Handshaken, Message

    ca = credentials.new_authority()

    def config(rank: int) -> Config:
        mine = credentials.issue(ca, rank, 1)
        key = mine.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
        return Config(cert_pem=mine.cert.public_bytes(serialization.Encoding.PEM), key_pem=key, ca_pem=mine.ca_pem,
                      datagram=datagram, cc=cc, window=2 * size)

    now, got, sent, cpu_send, cpu_recv = 1.0, 0, False, 0.0, 0.0
    client = Connection.dial(config(0), ("10.0.0.1", 1), ("10.0.0.2", 2), now)
    first = client.datagrams_to_send(now)
    server = Connection.accept(config(1), ("10.0.0.2", 2), ("10.0.0.1", 1), first[0], now)
    server.receive(first[1:], now)
    chunk = b"x" * stream
    while got < size:
        now += 0.0005
        a = time.process_time()
        for conn in (client, server):
            due = conn.get_timer()
            if due is not None and due <= now:
                conn.handle_timer(now)
        out = client.datagrams_to_send(now)
        b = time.process_time()
        server.receive(out, now)
        while (ev := server.next_event()) is not None:
            if isinstance(ev, Message):
                got += len(ev.data)
        back = server.datagrams_to_send(now)
        c = time.process_time()
        client.receive(back, now)
        while (ev := client.next_event()) is not None:
            if isinstance(ev, Handshaken) and not sent:
                for _ in range(size // stream):
                    client.send(chunk)
                sent = True
        d = time.process_time()
        cpu_send += (b - a) + (d - c)
        cpu_recv += c - b
    mb = size / 1e6
    return mb / cpu_send, mb / cpu_recv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datagram", type=int, default=1452)
    ap.add_argument("--size", default="64M")
    ap.add_argument("--streams", default="1M,16M,64M", help="bytes per stream, comma-separated")
    ap.add_argument("--engines", default="aioquic", help="aioquic, qh3 (pip install qh3), ngtcp2, quinn, erdma-ngtcp2; "
                    "comma-separated")
    ap.add_argument("--cc", default="cubic", help="the compiled engines' controller: reno, cubic, bbr (ngtcp2: bbr2 too)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each case; the median is printed")
    args = ap.parse_args()
    size = parse_size(args.size)
    print(f"{'engine':<12} {'cc':>6} {'datagram':>9} {'stream':>8} {'streams':>8} {'sender MB/CPU-s':>16} "
          f"{'receiver MB/CPU-s':>18}")
    for engine in args.engines.split(","):
        for text in args.streams.split(","):
            stream = parse_size(text)
            runs = [run_compiled(engine, args.datagram, size, stream, args.cc) if engine in ("ngtcp2", "quinn")
                    else run_engine(args.datagram, size, stream, args.cc) if engine == "erdma-ngtcp2"
                    else run(args.datagram, size, stream, engine) for _ in range(args.repeats)]
            snd, rcv = (sorted(r[i] for r in runs)[len(runs) // 2] for i in (0, 1))
            cc = args.cc if engine in ("ngtcp2", "quinn", "erdma-ngtcp2") else "own"
            print(f"{engine:<12} {cc:>6} {args.datagram:>9} {text:>8} {size // stream:>8} {snd:>16.1f} {rcv:>18.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
