"""One hivemind 1.1.12 peer of ``benchmarks.decentralized``: averages a float32 tensor of ``--size`` elements with
``DecentralizedAverager`` and 8-bit quantization (``Uniform8BitQuantization``), ``--rounds`` times, and prints
``round K ok SECONDS`` (the time of ``step``, matchmaking included) or ``round K failed``.

    python benchmarks/hivemind_peer.py --public --host 198.51.100.1 --size N --rounds R --group G
    python benchmarks/hivemind_peer.py --initial-peers MADDR[,MADDR] --size N --rounds R --group G

``--public``: the DHT's first node and a full averager (it accepts connections, so it takes the parts of the
all-reduce: peers behind NATs run in client mode and aggregate nothing) that contributes weight 0; it prints
``maddrs ...`` for the others. Run with a Python that has hivemind (its own venv: it pins torch and protobuf)."""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--public", action="store_true")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--initial-peers", default="")
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--matchmaking", type=float, default=3.0)
    args = ap.parse_args()
    import hivemind
    import torch
    from hivemind.compression import Uniform8BitQuantization

    peers = [p for p in args.initial_peers.split(",") if p]
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{args.host}/tcp/0"], initial_peers=peers,
                       client_mode=not args.public)
    if args.public:
        print("maddrs " + ",".join(str(a) for a in dht.get_visible_maddrs()), flush=True)
    tensor = torch.zeros(args.size, dtype=torch.float32)
    averager = hivemind.averaging.DecentralizedAverager(
        averaged_tensors=[tensor], dht=dht, prefix="decentralized-bench", target_group_size=args.group,
        min_group_size=args.group, min_matchmaking_time=args.matchmaking, request_timeout=1.0,
        client_mode=not args.public, compression=Uniform8BitQuantization(), start=True)
    value = 0.0 if args.public else float(hash(dht.peer_id) % 97 + 1)
    for k in range(args.rounds):
        with averager.get_tensors() as tensors:
            tensors[0].fill_(value)
        t0 = time.monotonic()
        try:
            got = averager.step(weight=0.0 if args.public else 1.0, timeout=300.0)
        except Exception as exc:  # a failed round is reported, not fatal
            print(f"round {k} failed {type(exc).__name__}: {exc}", flush=True)
            continue
        took = time.monotonic() - t0
        print(f"round {k} {'ok' if got is not None else 'failed'} {took:.4f}", flush=True)
    averager.shutdown()
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
