"""One hivemind 1.1.12 peer of ``benchmarks.decentralized``: averages a float32 tensor of ``--size`` elements with
``DecentralizedAverager`` and 8-bit quantization (``Uniform8BitQuantization``), ``--rounds`` times, and prints
``round K ok SECONDS MEAN`` (the time of ``step``, matchmaking included, and the mean of the averaged tensor)
or ``round K failed``; first ``value V``, the mean of what this peer contributes. The caller checks each
round's MEAN against the mean of the contributions: hivemind's reducer goes on without a sender whose part it
could not read (it logs "Reducer: received N% of input tensors"), so a round that returns is not a right one.

    python benchmarks/hivemind_peer.py --public --host 198.51.100.10 --size N --rounds R --group G
    python benchmarks/hivemind_peer.py --initial-peers MADDR[,MADDR] --size N --rounds R --group G

``--public``: a peer with a public address, the DHT's first node and a full averager (it accepts connections, so
it takes the parts of the all-reduce: peers behind NATs run in client mode and aggregate nothing); it prints
``maddrs ...`` for the others. Every peer contributes with weight 1.

Run with a Python that has hivemind and numpy < 2 (its own venv; hivemind 1.1.12's 8-bit codec reads its header
with ``int(np.frombuffer(..., count=1))``, which numpy 2 refuses, and the reducer then drops every part sent to it):

    python3 -m venv /tmp/hmvenv && /tmp/hmvenv/bin/pip install hivemind==1.1.12 "numpy<2"
"""

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
    # a spread around a level of this peer's (a constant tensor has no spread for the 8-bit codec's scale)
    level = float(hash(dht.peer_id) % 97 + 1)
    mine = level + torch.randn(args.size, generator=torch.Generator().manual_seed(int(level)), dtype=torch.float32)
    value = float(mine.double().mean())
    print(f"value {value:.6f}", flush=True)
    for k in range(args.rounds):
        with averager.get_tensors() as tensors:
            tensors[0].copy_(mine)
        t0 = time.monotonic()
        try:
            got = averager.step(weight=1.0, timeout=300.0)
        except Exception as exc:  # a failed round is reported, not fatal
            print(f"round {k} failed {type(exc).__name__}: {exc}", flush=True)
            continue
        took = time.monotonic() - t0
        if got is None:
            print(f"round {k} failed (no group)", flush=True)
            continue
        with averager.get_tensors() as tensors:
            mean = float(tensors[0].double().mean())
        print(f"round {k} ok {took:.4f} {mean:.6f}", flush=True)
    if args.public:  # its step returns before every client has its averaged parts: let them arrive
        time.sleep(10.0)
    averager.shutdown()
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
