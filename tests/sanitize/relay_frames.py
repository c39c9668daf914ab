"""The network lab's relay (benchmarks/netlab/relay.c), built with AddressSanitizer and UBSan (``build.py``),
fed malformed frames:

    python relay_frames.py BUILT CORPUS [--mutations N] [--seed S]

The relay runs with delay, jitter, loss and reordering on two ports that are datagram socket pairs (``fd:N``)
instead of interfaces; the corpus's Ethernet frames (``corpus/relay.txt``) and ``N`` mutations of each go in
on both ports, what comes out is read, and SIGTERM ends it. A sanitizer that finds a fault ends the relay
with its report (exit status not 0), and so this script. Prints the relay's counters."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import time

from mutate import arguments, corpus, mutations


def main() -> None:
    args = arguments()
    rng = random.Random(args.seed)
    seeds = corpus(args.corpus / "relay.txt")
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(2)]
    theirs = [b for _, b in pairs]
    for s in theirs:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    relay = subprocess.Popen([str(args.built / "erdma-relay"), "--delay-us", "200", "--jitter-us", "100",
                              "--loss-ppm", "10000", "--reorder-ppm", "100000", "--reorder-gap-us", "300",
                              "--slots", "256", *(f"fd:{a.fileno()}" for a, _ in pairs)],
                             pass_fds=[a.fileno() for a, _ in pairs], stdout=subprocess.PIPE, text=True)
    for a, _ in pairs:
        a.close()
    assert relay.stdout is not None
    assert json.loads(relay.stdout.readline())["ready"], "the relay did not start"
    for s in theirs:
        s.setblocking(False)
    sent = got = 0
    frames = [f for seed in seeds for f in [seed, *mutations(rng, seed, seeds, args.mutations)]]
    for i, data in enumerate(frames):
        try:
            theirs[i % 2].send(data[:9216] if data else b"\x00")
            sent += 1
        except BlockingIOError:
            time.sleep(0.001)
        for s in theirs:
            while True:
                try:
                    s.recv(65536)
                    got += 1
                except BlockingIOError:
                    break
    time.sleep(0.2)
    relay.send_signal(signal.SIGTERM)
    out, _ = relay.communicate(timeout=30)
    if relay.returncode != 0:
        raise SystemExit(f"sanitize: relay: exited with {relay.returncode} (a sanitizer's report is above)")
    print(f"sanitize: relay: sent {sent}, came out {got}, counters {out.strip()}", flush=True)


if __name__ == "__main__":
    main()
