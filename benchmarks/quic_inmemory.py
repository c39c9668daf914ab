"""aioquic's CPU cost with no sockets: two sans-IO connections handed each other's datagrams in memory,
one-way SIZE bytes split over streams of STREAM bytes, all opened at once. Prints MB per CPU-second of the
sender and of the receiver (needs erdma-quic installed).

    python -m benchmarks.quic_inmemory --datagram 1452 --streams 1M,16M,64M
"""

from __future__ import annotations

import argparse
import time

from erdma_core.bench import parse_size


def run(datagram: int, size: int, stream: int) -> tuple[float, float]:
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection
    from aioquic.quic.events import HandshakeCompleted, StreamDataReceived
    from erdma_quic import credentials as cred

    ca = cred.new_authority()
    creds = cred.issue(ca, 0, 1)
    limits = {"max_datagram_size": datagram, "max_data": 4 * size, "max_stream_data": 2 * stream}
    ccfg = QuicConfiguration(is_client=True, alpn_protocols=["b"], server_name=creds.name, **limits)
    ccfg.cadata = ca.pem
    scfg = QuicConfiguration(is_client=False, alpn_protocols=["b"], **limits)
    scfg.certificate, scfg.private_key = creds.cert, creds.key
    client = QuicConnection(configuration=ccfg)
    server = QuicConnection(configuration=scfg, original_destination_connection_id=client.original_destination_connection_id)
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
            if isinstance(ev, StreamDataReceived):
                got += len(ev.data)
        back = server.datagrams_to_send(now=now)
        c = time.process_time()
        for data, _ in back:
            client.receive_datagram(data, ("10.0.0.1", 1), now=now)
        while (ev := client.next_event()) is not None:
            if isinstance(ev, HandshakeCompleted) and not sent:
                for _ in range(size // stream):
                    sid = client.get_next_available_stream_id(is_unidirectional=True)
                    client.send_stream_data(sid, chunk, end_stream=True)
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
    args = ap.parse_args()
    size = parse_size(args.size)
    print(f"{'datagram':>9} {'stream':>8} {'streams':>8} {'sender MB/CPU-s':>16} {'receiver MB/CPU-s':>18}")
    for text in args.streams.split(","):
        stream = parse_size(text)
        snd, rcv = run(args.datagram, size, stream)
        print(f"{args.datagram:>9} {text:>8} {size // stream:>8} {snd:>16.1f} {rcv:>18.1f}")


if __name__ == "__main__":
    main()
