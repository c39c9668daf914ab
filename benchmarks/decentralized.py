"""The decentralized job as one system, in the NAT bed (``erdma_p2p.lab``): DiLoCo (``examples/diloco.py``) with
int8 pseudo-gradients on an elastic group whose membership lives in an etcd member on the public segment, peers
at sites behind every kind of NAT, one killed mid-job and a newcomer admitted from behind a NAT that maps each
destination anew. Per outer step: when it ended, the members, the averaging time (the inner steps are the same
for any system), and whether every member's state hash agrees; per epoch: which pairs run direct or relayed
and on which transport; the bytes the TURN server relayed; how long the job took to step again after the kill
and to take the newcomer in. With ``--systems erdma,hivemind``, hivemind 1.1.12's ``DecentralizedAverager``
averages a tensor of the same size with 8-bit quantization in the same bed (``benchmarks/hivemind_peer.py``:
site 0's peer, with no NAT, a full averager that reduces every part; the peers behind NATs in client mode), each
round's average checked, and both are reported side by side.

    python -m benchmarks.decentralized --params-mib 16 --outer-steps 14 --json out.json
    python -m benchmarks.decentralized --systems erdma,hivemind --hivemind-python /tmp/hmvenv/bin/python

Sites: 0 public (no NAT), 1..P-2 masquerade (endpoint-independent), P-1 and the newcomer's fully-random
(symmetric). Each site's link to the public segment is capped at ``--rate`` both ways (htb on the bed's
bridge ports); no delay is added (this kernel has no netem, and the bed's routers are namespaces). Needs root,
coturn, stund, etcd (``scripts/system-deps.sh test``)."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from erdma_core.testing.elastic import Peer

ROOT = Path(__file__).resolve().parent.parent
OUTER = re.compile(r"^outer (\d+) epoch (\d+) members (\d+) \[(.*)\] hash (\w+) loss (\S+) avg_s ([\d.]+) "
                   r"at ([\d.]+)")
PATHS = re.compile(r"rank (\d+): paths to its peers: (.*)$")
PATH = re.compile(r"rank (\d+) at ([\d.]+):\d+ (direct|relayed) (\w+)")
ETCD = ("198.51.100.1", 2379)


def hidden_for(mib: float) -> int:
    """diloco.py's ``--hidden`` for a model of ``mib`` MiB of float32 parameters ((32 + 2) x hidden + 1)."""
    return max(1, round((mib * (1 << 20) / 4 - 1) / 34))


def start(name: str, cmd: list[str], env: dict[str, str], ns: str, folder: Path) -> Peer:
    """``cmd`` in the namespace ``ns``, its output read as it comes (``Peer``), kept in ``folder/NAME.log``."""
    proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return Peer(proc, folder / f"{name}.log")


def outer(peer: Peer) -> list[re.Match[str]]:
    """The outer steps a DiLoCo peer printed."""
    return [m for line in list(peer.lines) if (m := OUTER.match(line))]


def serve_etcd(lab: Any, folder: Path) -> subprocess.Popen[bytes]:
    """One etcd member on the public segment (its data in memory)."""
    data = Path(tempfile.mkdtemp(prefix="erdma-etcd-", dir="/dev/shm"))
    url = f"http://{ETCD[0]}:{ETCD[1]}"
    proc = subprocess.Popen(["ip", "netns", "exec", lab.ns("pub"), "etcd", "--name", "bed", "--data-dir", str(data),
                             "--listen-client-urls", url, "--advertise-client-urls", url,
                             "--listen-peer-urls", "http://127.0.0.1:2380",
                             "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                             "--initial-cluster", "bed=http://127.0.0.1:2380"],
                            stdout=open(folder / "etcd.log", "w"), stderr=subprocess.STDOUT)
    for _ in range(100):
        ok = subprocess.run(["ip", "netns", "exec", lab.ns("pub"), "etcdctl", "--endpoints", url, "endpoint",
                             "health"], capture_output=True).returncode == 0
        if ok:
            return proc
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"etcd did not come up: {(folder / 'etcd.log').read_text()[-2000:]}")


def relay_counter(lab: Any) -> None:
    """Count what coturn sends from its relayed ports (what it relays towards the sites)."""
    rules = ("table ip relaycount {\n  counter relayed {}\n  chain out {\n    type filter hook output priority 0;\n"
             "    udp sport 49152-65535 counter name relayed\n  }\n}\n")
    subprocess.run(["ip", "netns", "exec", lab.ns("pub"), "nft", "-f", "-"], input=rules, text=True, check=True)


def relayed_bytes(lab: Any) -> int:
    out = subprocess.run(["ip", "netns", "exec", lab.ns("pub"), "nft", "list", "counter", "ip", "relaycount",
                          "relayed"], capture_output=True, text=True).stdout
    found = re.search(r"bytes (\d+)", out)
    return int(found[1]) if found else 0


def run_erdma(lab: Any, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    from erdma_p2p.lab.jobs import RELAY
    from erdma_p2p.lab.natlab import STUN

    etcd = serve_etcd(lab, folder)
    relay_counter(lab)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_")} | RELAY | {
        "ERDMA_INIT_METHOD": f"etcd://{ETCD[0]}:{ETCD[1]}/decentralized", "ERDMA_SECRET": "decentralized-bench",
        "ERDMA_TRANSPORT": "tcp", "ERDMA_TRANSPORT_FALLBACK": "quic",
        "ERDMA_TRAVERSAL_STUN_SERVER": f"{STUN[0]}:{STUN[1]}", "ERDMA_ELASTIC_MIN_PEERS": str(args.peers),
        "ERDMA_ELASTIC_LIVENESS_TIMEOUT": str(args.liveness), "ERDMA_TIMEOUTS_CONNECT": "30",
        "ERDMA_TIMEOUTS_COLLECTIVE": "120", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    code = ("import logging, runpy, sys; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
            f"sys.argv = ['diloco', *{_diloco_args(args)!r}]; "
            f"runpy.run_path({str(ROOT / 'examples' / 'diloco.py')!r}, run_name='__main__')")
    cmd = [sys.executable, "-c", code]
    peers = [start(f"erdma-site{i}", cmd, env, lab.host(i), folder) for i in range(args.peers)]
    events: dict[str, float] = {}
    newcomer: Peer | None = None
    victim = peers[1]
    end = time.monotonic() + args.timeout
    try:
        while time.monotonic() < end:
            done = [p for p in peers if not p.alive() and p is not victim]
            steps = max((len(outer(p)) for p in peers), default=0)
            if "kill" not in events and steps >= args.kill_at:
                victim.kill()
                events["kill"], events["kill_mono"] = time.time(), time.monotonic()
            if newcomer is None and steps >= args.join_at:
                newcomer = start(f"erdma-site{args.peers}", cmd, env, lab.host(args.peers), folder)
                peers.append(newcomer)
                events["join"] = time.time()
            if newcomer is not None and len(done) >= len(peers) - 1:
                break
            time.sleep(0.1)
    finally:
        for p in peers:
            p.kill()
        etcd.kill()
    return summarize_erdma(peers, victim, newcomer, events, relayed_bytes(lab), args)


def _diloco_args(args: argparse.Namespace) -> list[str]:
    return ["--compress", "int8", "--hidden", str(hidden_for(args.params_mib)), "--outer-steps", str(args.outer_steps),
            "--inner-steps", str(args.inner_steps), "--data-seed", "0"]


def summarize_erdma(peers: list[Peer], victim: Peer, newcomer: Peer | None, events: dict[str, float],
                    relayed: int, args: argparse.Namespace) -> dict[str, Any]:
    steps: dict[int, list[tuple[float, int, str, float, int]]] = {}  # outer -> (at, members, hash, avg_s, epoch)
    for p in peers:
        for m in outer(p):
            steps.setdefault(int(m[1]), []).append((float(m[8]), int(m[3]), m[5], float(m[7]), int(m[2])))
    rows = []
    prev = None
    for step in sorted(steps):
        got = steps[step]
        at = max(g[0] for g in got)
        rows.append({"outer": step, "at": at, "since_last_s": None if prev is None else at - prev,
                     "members": got[0][1], "printed": len(got), "hashes_agree": len({g[2] for g in got}) == 1,
                     "averaging_s": statistics.median(g[3] for g in got),
                     "averaging_s_min": min(g[3] for g in got), "epoch": got[0][4]})
        prev = at
    site_of = {f":{p.pid}": i for i, p in enumerate(peers)}  # a member's name is host:pid
    paths: dict[int, dict[str, dict[str, str]]] = {}  # epoch -> "site i" -> "site j" -> "direct TCP" ...
    for i, p in enumerate(peers):
        said: list[list[tuple[str, str, str, str]]] = []  # since the last outer step (a newcomer's path checks
        # are groups of two that say their paths too: the epoch's is the last with a peer per other member)
        for line in p.lines:
            if (m := PATHS.search(line)) is not None:
                said.append(PATH.findall(m[2]))
            elif (m := OUTER.match(line)) is not None and said:
                names = m[4].split(", ")
                sites = [next((v for k, v in site_of.items() if n.endswith(k)), -1) for n in names]
                for rank, _, how, over in next((s for s in reversed(said) if len(s) == len(names) - 1), []):
                    paths.setdefault(int(m[2]), {}).setdefault(f"site{i}", {})[f"site{sites[int(rank)]}"] = \
                        f"{how} {over}"
                said = []
    recover = in_step = None
    if "kill" in events:
        after = [r for r in rows if r["at"] > events["kill"] and r["members"] == args.peers - 1]
        recover = after[0]["at"] - events["kill"] if after else None
        # the kill lands between steps: the survivors first finish their inner steps. The survivors' first step
        # then holds the recovery (the failed averaging, the ballot, the new epoch's set-up, the averaging
        # again), and its last member waited for nobody's inner steps
        in_step = after[0]["averaging_s_min"] if after else None
    admitted = None
    if "join" in events:
        after = [r for r in rows if r["at"] > events["join"] and r["members"] == args.peers]
        admitted = after[0]["at"] - events["join"] if after else None
    formed = None  # kill -> the survivors' next epoch up (its rank 0 says "erdma elastic: epoch N: ...")
    if "kill_mono" in events:
        ups = [t for p in peers for t, line in zip(list(p.times), list(p.lines), strict=False)
               if line.startswith("erdma elastic: epoch") and t > events["kill_mono"]]
        formed = min(ups) - events["kill_mono"] if ups else None
    undisturbed = [r["since_last_s"] for r in rows if r["since_last_s"] is not None and r["epoch"] == rows[0]["epoch"]]
    said = [line for p in peers for line in p.lines if "Error" in line or "Traceback" in line]
    return {"rows": rows, "paths": paths, "relayed_bytes": relayed, "recovery_after_kill_s": recover,
            "epoch_after_kill_s": formed, "recovery_step_s": in_step,
            "newcomer_admitted_s": admitted, "undisturbed_step_s": statistics.median(undisturbed) if undisturbed else None,
            "averaging_s_median": statistics.median(r["averaging_s"] for r in rows) if rows else None,
            # the member that came last to a step waited for nobody's inner steps: its time is the averaging's own
            "averaging_s_last_member_median": statistics.median(r["averaging_s_min"] for r in rows) if rows else None,
            "all_hashes_agree": all(r["hashes_agree"] for r in rows), "errors": said[:10],
            "newcomer_steps": len(outer(newcomer)) if newcomer is not None else 0}


def run_hivemind(lab: Any, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """hivemind's averager, one peer per site as eRDMA's: site 0's (no NAT) is a full averager and the DHT's first
    node, so it takes every part of the all-reduce (a peer in client mode aggregates nothing, and hivemind puts
    every peer behind a NAT in client mode); the sites behind NATs run in client mode. ``--outer-steps`` rounds
    of a tensor of the model's size, each peer's link capped as eRDMA's are."""
    py = args.hivemind_python
    script = str(ROOT / "benchmarks" / "hivemind_peer.py")
    n = hidden_for(args.params_mib) * 34 + 1
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", ""),
           "HIVEMIND_LOGLEVEL": os.environ.get("HIVEMIND_LOGLEVEL", "WARNING")}
    common = ["--size", str(n), "--rounds", str(args.outer_steps), "--group", str(args.peers)]
    public = start("hivemind-site0", [py, script, "--public", "--host", lab.wan(0), *common], env, lab.host(0), folder)
    end = time.monotonic() + 120
    maddr = None
    while maddr is None and time.monotonic() < end and public.proc.poll() is None:
        maddr = next((line.split(" ", 1)[1] for line in list(public.lines) if line.startswith("maddrs ")), None)
        time.sleep(0.1)
    if maddr is None:
        public.kill()
        return {"error": "site 0's hivemind peer did not start: " + " | ".join(public.lines[-5:])}
    peers = [public] + [start(f"hivemind-site{i}", [py, script, "--initial-peers", maddr, *common], env,
                              lab.host(i), folder) for i in range(1, args.peers)]
    end = time.monotonic() + args.timeout
    try:
        while time.monotonic() < end and any(p.alive() for p in peers):
            time.sleep(0.2)
    finally:
        for p in peers:
            p.kill()
    values = [float(line.split()[1]) for p in peers for line in p.lines if line.startswith("value ")]
    want = statistics.fmean(values) if len(values) == len(peers) else None
    by_round: dict[int, list[float]] = {}
    failed = wrong = 0
    for p in peers:
        for line in p.lines:
            words = line.split()
            if line.startswith("round ") and words[2] == "ok":
                # right within 8-bit quantization's error of the spread of the contributions (values 1..97)
                if want is None or abs(float(words[4]) - want) > 1.0:
                    wrong += 1
                    continue
                by_round.setdefault(int(words[1]), []).append(float(words[3]))
            elif line.startswith("round "):
                failed += 1
    rounds = [t for ts in by_round.values() for t in ts]
    errors = [line for p in peers for line in p.lines if "Error" in line][:10]
    return {"rounds_ok": len(rounds), "rounds_failed": failed, "rounds_wrong": wrong, "expected_mean": want,
            "averaging_s_median": statistics.median(rounds) if rounds else None,
            "averaging_s_last_member_median": statistics.median(min(ts) for ts in by_round.values()) if rounds
            else None, "per_round": {k: sorted(v) for k, v in sorted(by_round.items())}, "errors": errors}


def report(out: dict[str, Any]) -> str:
    """The run as text: the command's settings, eRDMA's outer steps, its paths, and hivemind beside it."""
    a = out["args"]
    lines = [f"python -m benchmarks.decentralized --systems {a['systems']} --params-mib {a['params_mib']:g} "
             f"--outer-steps {a['outer_steps']} --inner-steps {a['inner_steps']} --kill-at {a['kill_at']} "
             f"--join-at {a['join_at']} --rate {a['rate']}",
             f"({out['when']}, commit {out.get('commit', '?')}, {a['peers']} peers + 1 newcomer, liveness "
             f"{a['liveness']:g} s, etcd 1 member on the public segment)"]
    e = out.get("erdma")
    if e:
        lines += ["", "eRDMA: DiLoCo, int8 pseudo-gradients, TCP with QUIC as the fallback, TURN relay",
                  "  outer epoch members printed  step_s  averaging_s (median / last member)  hashes"]
        for r in e["rows"]:
            step = "      -" if r["since_last_s"] is None else f"{r['since_last_s']:7.2f}"
            lines.append(f"  {r['outer']:5d} {r['epoch']:5d} {r['members']:7d} {r['printed']:7d} {step}  "
                         f"{r['averaging_s']:8.3f} / {r['averaging_s_min']:6.3f}"
                         f"{'':21s}{'agree' if r['hashes_agree'] else 'DIFFER'}")
        for epoch, sites in sorted(e["paths"].items(), key=lambda kv: int(kv[0])):
            row = "; ".join(f"{site} " + ", ".join(f"{n} {kind}" for kind, n in sorted(_count(seen).items()))
                            for site, seen in sorted(sites.items()))
            lines.append(f"  epoch {epoch} pairs: {row}")
        lines += [
                  f"  relayed by the TURN server: {e['relayed_bytes'] / 2**20:.1f} MiB",
                  f"  kill -> the survivors' epoch up: {_s(e.get('epoch_after_kill_s'))}, -> their first step: "
                  f"{_s(e['recovery_after_kill_s'])}; newcomer start -> first step "
                  f"with it: {_s(e['newcomer_admitted_s'])} (its steps: {e['newcomer_steps']})",
                  f"  the survivors' first step after the kill, its last member's averaging (the failed one, the "
                  f"ballot, the new epoch, the averaging again): {_s(e.get('recovery_step_s'))}",
                  f"  undisturbed step {_s(e['undisturbed_step_s'])}; averaging median {_s(e['averaging_s_median'])}, "
                  f"last member's {_s(e['averaging_s_last_member_median'])}; every step's hashes agree: "
                  f"{e['all_hashes_agree']}; errors: {len(e['errors'])}"]
    h = out.get("hivemind")
    if h:
        lines += ["", "hivemind 1.1.12: DecentralizedAverager, Uniform8BitQuantization; site 0's peer (no NAT) a full "
                  "averager that reduces every part, the other sites' in client mode"]
        if "error" in h:
            lines.append(f"  {h['error']}")
        else:
            lines += [f"  rounds right {h['rounds_ok']}, failed {h['rounds_failed']}, returned a wrong average "
                      f"{h.get('rounds_wrong', 0)}; averaging median "
                      f"{_s(h['averaging_s_median'])}, last member's {_s(h['averaging_s_last_member_median'])}"]
    if e and h and h.get("averaging_s_last_member_median") and e.get("averaging_s_last_member_median"):
        lines.append(f"\neRDMA / hivemind, averaging time per outer step (last member's, median): "
                     f"{e['averaging_s_last_member_median'] / h['averaging_s_last_member_median']:.2f}x")
    return "\n".join(lines) + "\n"


def _count(seen: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for how in seen.values():
        out[how] = out.get(how, 0) + 1
    return out


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=5)
    ap.add_argument("--params-mib", type=float, default=16.0)
    ap.add_argument("--outer-steps", type=int, default=14)
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=4, help="the peer at site 1 is killed after this outer step")
    ap.add_argument("--join-at", type=int, default=7, help="the newcomer starts after this outer step")
    ap.add_argument("--liveness", type=float, default=3.0)
    ap.add_argument("--rate", default="100mbit", help="each site's link to the public segment, both ways")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--systems", default="erdma")
    ap.add_argument("--hivemind-python", default="python3", help="a Python with hivemind 1.1.12 installed")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from erdma_p2p.lab.natlab import NatLab

    out: dict[str, Any] = {"args": vars(args), "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    folder = Path(tempfile.mkdtemp(prefix="erdma-decentralized-"))
    sites = args.peers + 1
    for system in args.systems.split(","):
        with NatLab(sites, folder, public=frozenset({0}), symmetric=frozenset({args.peers - 1, args.peers})) as lab:
            lab.cap_sites(args.rate)
            out[system] = run_erdma(lab, folder, args) if system == "erdma" else run_hivemind(lab, folder, args)
        print(json.dumps({system: out[system]}, indent=1), flush=True)
    out["logs"] = str(folder)
    out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                   cwd=ROOT).stdout.strip()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(report(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
