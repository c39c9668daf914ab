"""``erdma naca serve``: the aggregation node, the UDP adapter around ``aggregator.Aggregator``."""

from __future__ import annotations

import argparse
import logging
import random
import select
import signal
import socket
import subprocess
import sys
import time

from .aggregator import Aggregator
from .header import read_secret

log = logging.getLogger("erdma.naca.node")


def address_of(proc: subprocess.Popen[str], timeout: float = 30.0) -> str:
    """``HOST:PORT`` of an ``erdma naca serve`` started with ``stdout=PIPE, text=True``, from the line it prints
    once bound; RuntimeError (with what it printed) if that line does not come within ``timeout``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"erdma naca serve did not start in {timeout:.0f}s: {line!r}")
    return line.split()[4]


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    naca = subparsers.add_parser("naca", help="network-assisted collectives (erdma-naca)")
    sub = naca.add_subparsers(dest="naca_command", required=True)
    p = sub.add_parser("serve", help="run an aggregation node: ranks of jobs that select the naca algorithm "
                       "stream chunks to it, it reduces them and sends the results back")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=0, help="UDP port (0: a free one, printed at start)")
    p.add_argument("--slots", type=int, default=4096, help="aggregation slots of the whole node (default 4096)")
    p.add_argument("--job-slots", type=int, default=256, help="most slots one job (process group) may hold "
                   "(default 256)")
    p.add_argument("--secret-file", required=True, help="file holding the admission secret every job's ranks "
                   "must prove (the ranks' [algorithm.allreduce.naca] secret_file)")
    p.add_argument("--idle", type=float, default=300.0, help="seconds after which a silent job is forgotten")
    p.add_argument("--inject-loss", type=float, default=0.0, help="drop this fraction of datagrams received and "
                   "sent (testing)")
    p.set_defaults(handler=_serve_command)


def _serve_command(args: argparse.Namespace) -> int:
    for name, value, low in (("--slots", args.slots, 1), ("--job-slots", args.job_slots, 1)):
        if value < low:
            print(f"erdma naca serve: {name} {value} must be at least {low}", file=sys.stderr)
            return 2
    if not 0.0 <= args.inject_loss < 1.0:
        print(f"erdma naca serve: --inject-loss {args.inject_loss} must be in [0, 1)", file=sys.stderr)
        return 2
    try:
        secret = read_secret(args.secret_file)
    except ValueError as exc:
        print(f"erdma naca serve: --secret-file {args.secret_file!r}: {exc}", file=sys.stderr)
        return 2
    agg = Aggregator(secret, args.slots, args.job_slots, args.idle)
    serve(agg, args.host, args.port, args.inject_loss)
    return 0


def serve(agg: Aggregator, host: str, port: int, loss: float = 0.0) -> None:
    """Serve until SIGINT or SIGTERM; prints ``listening on HOST:PORT`` once bound."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    sock.bind((host, port))
    sock.setblocking(False)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    h, p = sock.getsockname()
    print(f"erdma naca: listening on {h}:{p} (slots {agg.slots}, {agg.job_slots} per job)", flush=True)
    rng = random.Random()
    next_expiry = time.monotonic() + 1.0
    while not stop:
        try:
            ready, _, _ = select.select([sock], [], [], 1.0)
        except InterruptedError:
            continue
        now = time.monotonic()
        for _ in range(256 if ready else 0):  # what is queued, in one go
            try:
                data, addr = sock.recvfrom(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionRefusedError:  # an ICMP error for an earlier send: nothing to do
                continue
            if loss and rng.random() < loss:
                continue
            for to, out in agg.handle(data, addr, now):
                if loss and rng.random() < loss:
                    continue
                try:
                    sock.sendto(out, to)
                except (BlockingIOError, ConnectionRefusedError, OSError) as exc:
                    log.debug("send to %s failed: %s", to, exc)
        if now >= next_expiry:
            agg.expire(now)
            next_expiry = now + 1.0
    sock.close()
    s = agg.stats
    print(f"erdma naca: stopped; {s.datagrams} datagrams, {s.results} chunks aggregated, {s.duplicates} duplicates, "
          f"{s.unknown_job} for unknown jobs, {s.bad_tag} bad tags, {s.malformed} malformed, {s.replays} replays, "
          f"{s.joins} joins, {s.challenges} challenges, {s.rejected_joins} refused, {s.given_up} given up",
          flush=True)
