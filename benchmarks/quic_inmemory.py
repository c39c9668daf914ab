"""aioquic's CPU cost with no sockets: two sans-IO connections handed each other's datagrams in memory,
one-way SIZE bytes split over streams of STREAM bytes, all opened at once. Prints MB per CPU-second of the
sender and of the receiver (needs erdma-quic installed; ``--engines aioquic,qh3`` compares with qh3).

    python -m benchmarks.quic_inmemory --datagram 1452 --streams 1M,16M,64M [--engines aioquic,qh3]
"""

from __future__ import annotations

import argparse
import time

from erdma_core.cli.bench import parse_size


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datagram", type=int, default=1452)
    ap.add_argument("--size", default="64M")
    ap.add_argument("--streams", default="1M,16M,64M", help="bytes per stream, comma-separated")
    ap.add_argument("--engines", default="aioquic", help="aioquic, qh3 (pip install qh3), comma-separated")
    args = ap.parse_args()
    size = parse_size(args.size)
    print(f"{'engine':<8} {'datagram':>9} {'stream':>8} {'streams':>8} {'sender MB/CPU-s':>16} "
          f"{'receiver MB/CPU-s':>18}")
    for engine in args.engines.split(","):
        for text in args.streams.split(","):
            stream = parse_size(text)
            snd, rcv = run(args.datagram, size, stream, engine)
            print(f"{engine:<8} {args.datagram:>9} {text:>8} {size // stream:>8} {snd:>16.1f} {rcv:>18.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
