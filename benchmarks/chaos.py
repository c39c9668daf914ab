"""A chaos soak of elastic membership: the DiLoCo example (``examples/diloco.py``) on 4 to 6 peers whose store is
a real 3-member etcd cluster (``--store etcd``) or, with ``--store dht``, no store at all: 3 DHT server nodes
(``erdma dht serve``) bootstrap a ``dht://`` job whose members decide membership among themselves and also serve
the DHT, and this process, the job's creator, writes its first epoch (``elastic.founding``). The job runs under a
stream of random events, then as many outer steps undisturbed (with no ``--step-time`` sleeps: that run is there
for its final loss; ``--no-calm`` skips it).

    python -m benchmarks.chaos --events 1200 --one-at-a-time --gap 1 --json chaos.json   # docs/benchmarks.md's run
    python -m benchmarks.chaos --events 300 --json chaos.json                          # events overlapping
    python -m benchmarks.chaos --store dht --events 300 --one-at-a-time                 # no server

Events, one every ``--gap`` seconds on average (exponential gaps; with ``--one-at-a-time``, each gap drawn only once
the job recovered from the event before, as below): a member SIGKILLed (while more than 3 members, peers that
printed outer steps, run), a member SIGSTOPped and sent SIGCONT 1.5 to 3 liveness timeouts later (one at a time,
while more than 3 members run), a new peer (while fewer than 6 run), the etcd leader or another etcd member
SIGKILLed and started again 2 to 5 s later (one at a time; with ``--store dht``: one of the DHT nodes). It reports
hangs (no outer step for ``--hang-s`` while peers run), outer steps whose state hash differs between peers, outer
steps a peer printed twice or that nobody printed, recovery times: from each event to the next outer step completed
after it, for a kill or a stop by members without that member (the step after one may still be a step it had voted
for) or, if it was not counted out, after it ran again, for a join by members with the newcomer; their median and
p99 by kind against the bound the issues set (on etcd, the liveness timeout plus two outer steps of a 30-step
undisturbed run made first; on ``dht://``, twice the liveness timeout plus one such step), the events never
recovered from, and the events alone (no other event in the two liveness timeouts before one nor before its recovery
ended); and the final loss beside the undisturbed run's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from erdma_core.testing.elastic import ElasticJob, Peer, python
from erdma_core.testing.etcd import EtcdCluster, missing

from .dht_nodes import DhtNodes

ROOT = Path(__file__).resolve().parents[1]
OUTER = re.compile(r"^outer (\d+) epoch (\d+) members (\d+) \[(.*)\] hash (\w+) loss ([\d.]+)")
FINAL = re.compile(r"^final loss ([\d.]+)")
RECOVERY_S = {"etcd": 1.5, "dht": 3.0}  # seconds a recovery is allowed in the steps --one-at-a-time plans for
# (etcd: 300 events at a mean gap of 2 s, overlapping, median 0.53 s; dht://: joins, the slowest, 2.2 s median)
SECRET = "elastic-test"
DHT_SECTION = {"port": 0, "bind_address": "127.0.0.1", "rpc_timeout": 1.0, "poll_max": 0.1, "ttl": 3600.0}
DHT_ENV = {"ERDMA_DISCOVERY_DHT_SERVE": "1", "ERDMA_DISCOVERY_DHT_BIND_ADDRESS": "127.0.0.1",
           "ERDMA_DISCOVERY_DHT_RPC_TIMEOUT": "1.0", "ERDMA_DISCOVERY_DHT_POLL_MAX": "0.1"}


def _name(peer: Peer) -> str:
    """The name an elastic member goes by in the outer lines (host:pid)."""
    return f"{socket.gethostname()}:{peer.pid}"


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


class Soak:
    def __init__(self, job: ElasticJob, cluster: EtcdCluster | DhtNodes | None, rng: random.Random,
                 liveness: float) -> None:
        self.job, self.cluster, self.rng, self.liveness = job, cluster, rng, liveness
        self.stopped: tuple[Peer, float] | None = None  # a SIGSTOPped peer and when to continue it
        self.etcd_down: tuple[int, float] | None = None  # an etcd member (a DHT node) killed and when to start it
        self.events: list[tuple[float, str, str | None]] = []  # (when, kind, the peer killed, stopped or started)
        self.continued: dict[str, list[float]] = {}  # a stopped member -> when it was sent SIGCONT
        self.started = time.monotonic()

    def steps(self) -> list[tuple[float, int, str]]:
        """(when, outer step, its members) of every outer line of every peer so far."""
        out = []
        for p in self.job.peers:
            for t, line in zip(p.times, p.lines, strict=False):
                m = OUTER.match(line)
                if m:
                    out.append((t, int(m.group(1)), m.group(4)))
        return out

    def back(self, at: float, peer: str | None) -> float | None:
        """When ``peer``, stopped at ``at``, was sent SIGCONT (None: not yet, or it was not stopped)."""
        return min((t for t in self.continued.get(peer or "", ()) if t > at), default=None)

    def due(self, now: float) -> None:
        if self.stopped and now >= self.stopped[1]:
            os.kill(self.stopped[0].pid, signal.SIGCONT)
            self.continued.setdefault(_name(self.stopped[0]), []).append(now)
            self.stopped = None
        if self.etcd_down and self.cluster is not None and now >= self.etcd_down[1]:
            self.cluster.start(self.etcd_down[0])
            self.etcd_down = None

    def event(self, now: float) -> None:
        live = [p for p in self.job.live() if self.stopped is None or p is not self.stopped[0]]
        latest = max(self.steps(), default=None)  # the latest outer step printed: its members, by name
        named = set(latest[2].split(", ")) if latest is not None else set()
        members = [p for p in live if _name(p) in named]
        kinds = []
        # only while the latest step had more than 3 members, more than 3 of them running: killing every
        # holder of the state while newcomers wait would end any job that keeps no checkpoint, and with no
        # store (dht://) an epoch of 2 cannot lose one (the survivor has no majority of it and pauses)
        if len(named) > 3 and len(members) > 3:
            kinds += ["kill", "kill"]
        if self.stopped is None and len(named) > 3 and len(members) > 3:
            kinds.append("stop")
        if len(self.job.live()) < 6:
            kinds += ["join", "join"]
        if isinstance(self.cluster, EtcdCluster) and self.etcd_down is None:
            kinds += ["etcd-leader", "etcd-member"]
        if isinstance(self.cluster, DhtNodes) and self.etcd_down is None:
            kinds.append("dht-node")
        if not kinds:  # 6 peers run, none of them a member yet, and an etcd member is down: nothing to do now
            return
        kind = self.rng.choice(kinds)
        peer = None
        if kind == "kill":
            peer = self.rng.choice(members)
            peer.kill()
        elif kind == "stop":
            peer = self.rng.choice(members)
            os.kill(peer.pid, signal.SIGSTOP)
            self.stopped = (peer, now + self.rng.uniform(1.5, 3.0) * self.liveness)
        elif kind == "join":
            peer = self.job.start()  # the newcomer: absorbed once the job steps with it
        elif kind == "dht-node":
            assert isinstance(self.cluster, DhtNodes)
            i = self.rng.randrange(len(self.cluster.ports))
            self.cluster.kill(i)
            self.etcd_down = (i, now + self.rng.uniform(2.0, 5.0))
        else:
            assert isinstance(self.cluster, EtcdCluster)
            lead = self.cluster.leader()
            i = lead if kind == "etcd-leader" else self.rng.choice([k for k in range(3) if k != lead])
            self.cluster.kill(i)
            self.etcd_down = (i, now + self.rng.uniform(2.0, 5.0))
        self.events.append((now, kind, None if peer is None else _name(peer)))


def _recovered(steps: list[tuple[float, int, str]], at: float, before: int, kind: str, peer: str | None,
               back: float | None) -> float | None:
    """When the job recovered from an event at ``at`` (the last outer step then: ``before``): the first outer
    step completed after it; for a kill or a stop, by members without the ``peer`` killed or stopped, or by any
    members once the stopped peer ran again (``back``: it was not counted out while stopped, and the job
    waited for it); for a join, by members with the newcomer ``peer``. None: not yet."""
    def absorbed(names: str) -> bool:
        if peer is None:
            return True
        if kind == "join":
            return peer in names.split(", ")
        return peer not in names.split(", ")
    return min((t for t, s, names in steps if t > at and s > before and (
        absorbed(names) or (back is not None and t > back))), default=None)


def _founded(nodes: DhtNodes, name: str) -> Any:
    """The creator of a ``dht://`` job: the first epoch's record, written on a thread once 4 peers drew
    tickets; returns the bulletin it writes on (closed after the job)."""
    from erdma_p2p.dht_store import DhtStore

    from erdma_core.elastic.founding import found

    bulletin = DhtStore(nodes.addresses(), name, SECRET.encode(), timeout=10.0, section=DHT_SECTION)
    threading.Thread(target=found, args=(bulletin, "default", 4, 300.0), daemon=True).start()
    return bulletin


def run_job(folder: Path, cluster: EtcdCluster | DhtNodes | None, args: argparse.Namespace, outer: int,
            events: int, rng: random.Random, step_time: float | None = None) -> dict[str, Any]:
    name = f"chaos-{folder.name}"
    store = cluster.url(name) if cluster is not None else None
    cmd = python(ROOT / "examples" / "diloco.py", "--outer-steps", str(outer), "--inner-steps", "20",
                 "--step-time", str(args.step_time if step_time is None else step_time))
    env = {"ERDMA_ELASTIC_LIVENESS_TIMEOUT": str(args.liveness), "ERDMA_TIMEOUTS_CONNECT": "30"}
    bulletin = None
    if isinstance(cluster, DhtNodes):  # every peer serves the DHT too; this process founds the job
        env.update(DHT_ENV)
        bulletin = _founded(cluster, name)
    with ElasticJob(cmd, folder, min_peers=4, store_url=store, env=env, secret=SECRET) as job:
        for _ in range(4):
            job.start()
        soak = Soak(job, cluster, rng, args.liveness)
        start = time.monotonic()
        nxt = start + 5.0 + rng.expovariate(1 / args.gap)
        hang = False
        waiting: tuple[float, int, str, str | None] | None = None  # --one-at-a-time: the last event (when, the
        # outer step then, its kind and peer) until the job recovered from it
        while job.live():
            now = time.monotonic()
            soak.due(now)
            seen = soak.steps()
            last = max((t for t, _, _ in seen), default=start)
            top = max((s for _, s, _ in seen), default=0)
            if now - last > args.hang_s and not (seen and top >= outer):
                hang = True
                break
            if waiting is not None and (_recovered(seen, *waiting, soak.back(waiting[0], waiting[3])) is not None
                                        or now - waiting[0] > args.hang_s):  # recovered, or never will: go on
                waiting, nxt = None, now + rng.expovariate(1 / args.gap)
            if len(soak.events) < events and now >= nxt and waiting is None and (not seen or top < outer - 5):
                soak.event(now)
                nxt = now + rng.expovariate(1 / args.gap)
                if args.one_at_a_time and soak.events and soak.events[-1][0] == now:
                    waiting = (now, top, *soak.events[-1][1:])
                print(f"\r{len(soak.events)}/{events} events, outer step {top}",
                      end="", file=sys.stderr, flush=True)
            time.sleep(0.05)
        if soak.stopped is not None:
            os.kill(soak.stopped[0].pid, signal.SIGCONT)
        codes = job.wait_all(60)
        print(file=sys.stderr)
        if bulletin is not None:
            bulletin.close()
        return _report(job, soak, codes, hang, outer, time.monotonic() - start)


def _report(job: ElasticJob, soak: Soak, codes: list[int | None], hang: bool, outer: int,
            took: float) -> dict[str, Any]:
    hashes: dict[int, set[str]] = collections.defaultdict(set)
    doubled = 0
    for p in job.peers:
        mine = [int(m.group(1)) for m in map(OUTER.match, p.lines) if m]
        doubled += len(mine) - len(set(mine))
        for m in filter(None, map(OUTER.match, p.lines)):
            hashes[int(m.group(1))].add(m.group(5))
    steps = sorted(soak.steps())
    recovery: dict[str, list[float]] = collections.defaultdict(list)
    timeline: list[tuple[float, str, float | None, bool]] = []  # (seconds in, kind, recovery, alone)
    times = [at for at, _, _ in soak.events]
    for i, (at, kind, peer) in enumerate(soak.events):
        after = _recovered(steps, at, max((s for t, s, _ in steps if t <= at), default=0), kind, peer,
                           soak.back(at, peer))
        if after is not None:
            recovery[kind].append(after - at)
        # alone: no other event in the 2 liveness timeouts before it, nor before its recovery ended
        alone = after is not None and (i == 0 or at - times[i - 1] > 2 * soak.liveness) and \
            (i + 1 == len(times) or times[i + 1] > after)
        timeline.append((round(at - soak.started, 2), kind, None if after is None else round(after - at, 3), alone))
    first: dict[int, float] = {}
    for t, step, _ in steps:
        first.setdefault(step, t)
    gaps = [first[k + 1] - first[k] for k in first if k + 1 in first]
    finals = [float(m.group(1)) for p in job.peers for m in map(FINAL.match, p.lines) if m]
    return {"events": collections.Counter(k for _, k, _ in soak.events), "seconds": round(took, 1),
            "hangs": int(hang or None in codes), "divergent": sum(len(h) > 1 for h in hashes.values()),
            "doubled": doubled, "lost": len(set(range(1, outer + 1)) - set(hashes)),
            "odd_exits": [c for c in codes if c not in (0, -9)],
            "recovery": {k: v for k, v in recovery.items()}, "timeline": timeline,
            "unrecovered": sum(r is None for _, _, r, _ in timeline),
            "step_s": statistics.median(gaps) if gaps else None,
            "final_loss": sorted(set(finals))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=60)
    ap.add_argument("--store", choices=("etcd", "dht"), default="etcd", help="where membership is kept: a 3-member "
                    "etcd cluster, or no store (dht://: 3 DHT server nodes bootstrap it, the members decide)")
    ap.add_argument("--gap", type=float, default=2.0, help="mean seconds between events (with --one-at-a-time: "
                    "from the job's recovery from one to the next)")
    ap.add_argument("--one-at-a-time", action="store_true", help="draw the next event's gap only once an outer "
                    "step completed after the last event (a failure at a time, as torchft's soak injects them; "
                    "a stopped member's SIGCONT and an etcd member's restart still come when they are due)")
    ap.add_argument("--liveness", type=float, default=3.0, help="elastic.liveness_timeout of the peers")
    ap.add_argument("--step-time", type=float, default=0.01, help="diloco.py --step-time (20 inner steps)")
    ap.add_argument("--outer-steps", type=int, default=0, help="outer steps of the job (0: enough for the events "
                    "at the undisturbed step's pace; no event comes in the last 5)")
    ap.add_argument("--hang-s", type=float, default=60.0, help="no outer step for this long: a hang")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--keep", default=None, help="write the peers' and etcd's logs under this folder and keep them")
    ap.add_argument("--no-calm", action="store_true", help="no undisturbed run of as many steps (its final loss)")
    args = ap.parse_args()
    if args.store == "etcd" and missing():
        print(f"chaos: {missing()}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="erdma-chaos-") as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        calm_dir, chaos_dir = Path(tmp) / "calm", Path(tmp) / "chaos"
        calm_dir.mkdir()
        chaos_dir.mkdir()
        with (EtcdCluster(3, Path(tmp)) if args.store == "etcd" else DhtNodes(3, Path(tmp))) as cluster:
            probe = run_job(calm_dir, cluster, args, 30, 0, random.Random(0))
            step_s = probe["step_s"] or 0.5
            per_event = args.gap + (RECOVERY_S[args.store] if args.one_at_a_time else 0.0)
            outer = args.outer_steps or int(args.events * per_event / step_s * 1.1) + 40  # the events end before
            # the job does (30 events ran through 193 steps of 323 with 1.3 here: 6.4 steps an event where this
            # allows 8; with --one-at-a-time --gap 1, 187 events took 745 steps where this allowed 1,970)
            chaos = run_job(chaos_dir, cluster, args, outer, args.events, random.Random(args.seed))
            calm = None
            if not args.no_calm:  # the same steps undisturbed, for the final loss only: no sleeping in them
                (calm_dir / "again").mkdir()
                calm = run_job(calm_dir / "again", cluster, args, outer, 0, random.Random(0), step_time=0.0)
    bound, rule = ((args.liveness + 2 * step_s, "liveness + 2 steps") if args.store == "etcd" else
                   (2 * args.liveness + step_s, "2 x liveness + 1 step"))
    where = "etcd 3 members" if args.store == "etcd" else "no store (dht://, 3 DHT nodes)"
    spacing = "one at a time, mean gap after recovery" if args.one_at_a_time else "mean gap"
    print(f"{sum(chaos['events'].values())} events over {chaos['seconds']} s ({dict(chaos['events'])}), 4-6 peers, "
          f"{where}, liveness {args.liveness} s, {outer} outer steps, {spacing} {args.gap} s")
    print(f"hangs {chaos['hangs']}, divergent steps {chaos['divergent']}, steps printed twice {chaos['doubled']}, "
          f"steps nobody printed {chaos['lost']}, odd exit codes {chaos['odd_exits']}")
    print(f"undisturbed outer step {step_s:.3f} s; recovery bound = {rule} = {bound:.2f} s")
    print("  kind          n   median    p99  (s, event to the next outer step: after a kill or stop one without "
          "that member, after a join one with the newcomer)")
    everything = []
    for kind, xs in sorted(chaos["recovery"].items()):
        everything += xs
        print(f"  {kind:<12}{len(xs):>3} {statistics.median(xs):8.2f} {_p99(xs):6.2f}")
    if everything:
        print(f"  {'all':<12}{len(everything):>3} {statistics.median(everything):8.2f} {_p99(everything):6.2f}"
              f"  ({'within' if _p99(everything) <= bound else 'above'} the bound)")
    print(f"  events never recovered from (no such step by the end): {chaos['unrecovered']}")
    alone = [r for _, _, r, lone in chaos["timeline"] if lone and r is not None]
    if alone:  # events that overlapped no other: what one failure costs by itself
        print(f"  {'alone':<12}{len(alone):>3} {statistics.median(alone):8.2f} {_p99(alone):6.2f}"
              f"  (no other event in the {2 * args.liveness:.0f} s before one, nor before its next outer step)")
    print(f"final loss {chaos['final_loss']}" + (f" (undisturbed {calm['final_loss']})" if calm else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "outer": outer, "chaos": chaos, "calm": calm,
                                               "bound_s": bound}, indent=1, default=dict))
    return 0 if not (chaos["hangs"] or chaos["divergent"] or chaos["doubled"] or chaos["lost"]) else 1


if __name__ == "__main__":
    sys.exit(main())
