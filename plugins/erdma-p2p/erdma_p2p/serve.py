"""``erdma dht serve``: a long-lived DHT server node, at a reachable address, that ranks join through
(``init_method = "dht://HOST:PORT/JOB"``). Several, bootstrapped through each other, keep the records of a
node that dies."""

from __future__ import annotations

import argparse
import signal
import threading


def serve(args: argparse.Namespace) -> int:
    from .dht import DhtNode
    from .dht_store import parse_url

    for name, value in (("--max-records", args.max_records), ("--per-source", args.per_source)):
        if value < 1:
            print(f"erdma dht serve: {name} {value} must be at least 1", flush=True)
            return 2
    bootstrap = parse_url(f"dht://{args.bootstrap}/x")[0] if args.bootstrap else []
    node = DhtNode(server=True, rpc_timeout=args.rpc_timeout, max_records=args.max_records, ttl=args.ttl,
                   per_source=args.per_source)
    try:
        host, port = node.start(args.bind, args.port, bootstrap, timeout=10.0)
    except (OSError, TimeoutError) as exc:
        node.stop()
        print(f"erdma dht serve: {exc}", flush=True)
        return 1
    print(f"erdma dht serve: serving on {host}:{port}"
          + (f", joined through {args.bootstrap}" if bootstrap else " (first node)"), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    node.stop()
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    dht = subparsers.add_parser("dht", help="the DHT that dht:// discovery uses (erdma-p2p)")
    sub = dht.add_subparsers(dest="dht_command", required=True)
    p = sub.add_parser("serve", help="run a long-lived DHT server node (until SIGINT or SIGTERM)")
    p.add_argument("--port", type=int, default=4222, help="UDP port (default 4222)")
    p.add_argument("--bind", default="0.0.0.0", help="local address (default every address)")
    p.add_argument("--bootstrap", default="", help="HOST:PORT[,HOST:PORT...] of nodes already serving")
    p.add_argument("--rpc-timeout", type=float, default=1.0, help="seconds to wait for another node's answer")
    p.add_argument("--max-records", type=int, default=100_000, help="records kept at most (when full, the oldest "
                   "of the address that sent the most goes)")
    p.add_argument("--per-source", type=int, default=10_000, help="records one sending address may have stored "
                   "here at most (its oldest goes for a new one)")
    p.add_argument("--ttl", type=float, default=7 * 86400.0, help="seconds a stored record is kept")
    p.set_defaults(handler=serve)
