"""The ``erdma`` command: run, bench, plugins, doctor, config show, and what plugins add (``erdma keys``)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

from ..errors import ErdmaError
from . import launcher


def _ranks(text: str) -> int:
    """argparse type of ``-n``: a whole number of ranks, at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"ranks to start: a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"ranks to start: at least 1, got {n}")
    return n


def _check_config(path: str | None) -> None:
    """The config the ranks will load (./erdma.toml, ERDMA_CONFIG and ERDMA_*): fail here, once, rather than in
    every rank. Without a secret in the environment, the launcher gives the ranks one (a new one, or the one
    --secret-file names), which the check assumes."""
    from ..api.join import load_config

    given = os.environ.get("ERDMA_SECRET") or os.environ.get("ERDMA_SECURITY_SECRET")
    assumed: dict[str, Any] = {} if given else {"security.secret": "(the one erdma run gives its ranks)"}
    load_config(path, **assumed)


def _run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("erdma run: give the command after --, e.g. erdma run -n 4 -- python train.py", file=sys.stderr)
        return 2
    if args.nprocs > args.max_ranks:
        print(f"erdma run: -n {args.nprocs} is above --max-ranks {args.max_ranks}, the most processes erdma run starts "
              f"on this host unless told (--max-ranks {args.nprocs} lifts it)", file=sys.stderr)
        return 2
    why = launcher.unstartable(cmd[0])
    if why is not None:
        print(f"erdma run: cannot start {cmd[0]!r}: {why}", file=sys.stderr)
        return 127
    _check_config(args.config)
    if args.elastic and args.join:
        print("erdma run: --elastic serves a job's store, --join joins one: give one of them", file=sys.stderr)
        return 2
    for name, needs in (("host", "--elastic"), ("port", "--elastic"), ("secret_file", "--elastic or --join"),
                        ("store", "--elastic")):
        if getattr(args, name) is not None and not (args.elastic or (args.join and name == "secret_file")):
            print(f"erdma run: --{name.replace('_', '-')} applies only to {needs}", file=sys.stderr)
            return 2
    for name in ("host", "port"):
        if args.store is not None and getattr(args, name) is not None:
            print(f"erdma run: --{name} names where this process serves the store; with --store it serves none",
                  file=sys.stderr)
            return 2
    if args.elastic or args.join:
        from . import elastic_launch

        return elastic_launch.run(args.nprocs, cmd, config=args.config, join=args.join,
                                  host=args.host or "127.0.0.1", port=args.port or 0, store_url=args.store,
                                  secret_file=args.secret_file,
                                  prefix=not args.no_prefix, timeout=args.timeout)
    return launcher.run(args.nprocs, cmd, config=args.config, prefix=not args.no_prefix, timeout=args.timeout)


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    if args.compare == "gloo":
        try:
            import torch.distributed  # noqa: F401
        except ImportError as exc:
            print(f"erdma bench: --compare gloo times torch.distributed's Gloo, so it needs torch, which does not "
                  f"import here ({exc}): pip install 'erdma-core[torch]'", file=sys.stderr)
            return 2
    if args.backend == "mpi":
        print("erdma bench: --backend mpi runs under mpirun: mpirun -n N python -m erdma_core.cli.bench "
              "--backend mpi", file=sys.stderr)
        return 2
    _check_config(args.config)
    cmd = [sys.executable, "-m", "erdma_core.cli.bench", *bench.forwarded(args)]
    return launcher.run(args.nprocs, cmd, config=args.config, prefix=False)


def _plugins(args: argparse.Namespace) -> int:
    from ..plugins.manager import components

    comps = components()
    print(f"{'plugin':<16} {'distribution':<18} {'version':<10} hooks / error")
    for p in comps.plugins:
        print(f"{p.name:<16} {comps.distribution(p.name):<18} {comps.version(p.name):<10} "
              f"{p.error or ', '.join(p.hooks)}")
    print()
    for kind in comps.by_kind:
        for name, c in sorted(comps.by_kind[kind].items()):
            print(f"  {kind:<11} {name:<28} ({c.plugin}) {c.description}{_adapted(comps, kind, name)}")
    for op, algos in sorted(comps.algorithms.items()):
        for name, c in sorted(algos.items()):
            print(f"  {'algorithm':<11} {op + ' ' + name:<28} ({c.plugin}) {c.description}"
                  f"{_adapted(comps, 'algorithm', f'{op} {name}')}")
    for var, (plugin, doc) in sorted(comps.environment.items()):
        print(f"  {'environment':<11} {var:<28} ({plugin}) {doc}")
    for (kind, name), why in sorted(comps.refused.items()):
        print(f"  {kind:<11} {name:<28} REFUSED: {why}")
    return 0


def _adapted(comps: Any, kind: str, name: str) -> str:
    version = comps.adapted.get((kind, name))
    return "" if version is None else f" [SDK {version}, through the adapter]"


def _doctor(args: argparse.Namespace) -> int:
    from ..net.addresses import interface_ipv4
    from ..plugins.manager import components

    print("interfaces:")
    for _, name in socket.if_nameindex():
        try:
            addr = interface_ipv4(name)
        except ErdmaError:
            addr = "(no IPv4)"
        print(f"  {name:<12} {addr}")
    gpus = sorted(Path("/dev").glob("nvidia[0-9]*"))
    print(f"GPU: {', '.join(str(g) for g in gpus) if gpus else 'none found (/dev/nvidia*)'}")
    ib = Path("/sys/class/infiniband")
    rdma = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    print(f"RDMA devices: {', '.join(rdma) if rdma else 'none (/sys/class/infiniband is empty or absent)'}")
    comps = components()
    for kind in comps.by_kind:
        print(f"{kind}: {', '.join(comps.names(kind))}")
    failed = [p for p in comps.plugins if p.error]
    for p in failed:
        print(f"plugin {p.name} ({comps.distribution(p.name)}) failed to load: {p.error}")
    from ..api.join import check_config, load_config

    problems = 0
    conf = load_config(None, comps, check=False)
    try:
        check_config(conf, comps)
    except ErdmaError as exc:  # what init would refuse; the plugins' reports follow all the same
        print(f"problem: {exc}")
        problems += 1
    from ..net import congestion

    said = congestion.describe(conf["transport.tcp.congestion"])
    print(said)
    problems += said.startswith("problem: ")
    for lines in comps.pm.hook.erdma_doctor(config=conf):
        for line in lines or ():
            print(line)
            problems += line.startswith("problem: ")
    return 1 if failed or problems else 0


def _config_show(args: argparse.Namespace) -> int:
    from ..api.join import load_config

    conf = load_config(args.config)
    width = max(len(k) for k, _, _ in conf.items())
    for key, _, source in conf.items():
        print(f"{key:<{width}} = {conf.shown(key):<24} # {source}")
    return 0


def add_core_commands(sub: Any) -> None:
    """The core's own subcommands."""
    from . import bench

    run = sub.add_parser("run", help="start N local ranks of a command")
    run.add_argument("-n", "--nprocs", type=_ranks, required=True)
    run.add_argument("--max-ranks", type=_ranks, default=launcher.MAX_RANKS, help="the most processes -n may ask for "
                     f"on this host (default {launcher.MAX_RANKS}): a guard against a typo starting thousands")
    run.add_argument("--config", default=None)
    run.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank N]")
    run.add_argument("--timeout", type=float, default=None, help="stop every rank after this many seconds")
    run.add_argument("--elastic", action="store_true", help="an elastic job (erdma_core.elastic): serve its "
                     "store here and keep the other peers going when one exits; prints how to add peers")
    run.add_argument("--join", metavar="HOST:PORT|URL", default=None, help="add the N peers to the elastic job "
                     "whose store `erdma run --elastic` serves at HOST:PORT, or whose store is at URL (etcd://..., "
                     "as `erdma run --elastic --store` printed it)")
    run.add_argument("--store", metavar="URL", default=None, help="--elastic: keep the job's membership on this "
                     "etcd cluster (etcd://HOST:PORT[,HOST:PORT...]/PREFIX; the job's keys go under PREFIX/<a new "
                     "job id>), or with no store at all, the members deciding among themselves and the DHT "
                     "carrying their records (dht://HOST:PORT[,HOST:PORT...]/JOB, erdma-p2p; the job is named "
                     "JOB-<hex>), instead of serving a store here: the job goes on without this process")
    run.add_argument("--host", default=None, help="--elastic: address to serve the store on (default "
                     "127.0.0.1; 0.0.0.0: every interface, for peers on other machines)")
    run.add_argument("--port", type=int, default=None, help="--elastic: port of the store (0: a free one)")
    run.add_argument("--secret-file", default=None, help="the job's secret (--elastic writes a new one to a "
                     "0600 file and prints its path when neither this nor ERDMA_SECRET is given)")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    run.set_defaults(handler=_run)
    b = sub.add_parser("bench", help="benchmark collectives on N local ranks: an nccl-tests style table")
    b.add_argument("-n", "--nprocs", type=_ranks, default=2, help="ranks to start (default 2)")
    b.add_argument("--config", default=None, help="erdma.toml for the ranks")
    bench.add_arguments(b)
    b.set_defaults(handler=_bench)
    sub.add_parser("plugins", help="installed plugins, what each provides, and load errors").set_defaults(
        handler=_plugins)
    sub.add_parser("doctor", help="what this host can use").set_defaults(handler=_doctor)
    config = sub.add_parser("config", help="config tools")
    csub = config.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print the effective config and where each value came from")
    show.add_argument("--config", default=None)
    show.set_defaults(handler=_config_show)


def main(argv: list[str] | None = None) -> int:
    from ..plugins.manager import components

    ap = argparse.ArgumentParser(prog="erdma", description="eRDMA collective communication")
    sub = ap.add_subparsers(dest="command", required=True)
    add_core_commands(sub)
    try:
        components().pm.hook.erdma_add_commands(subparsers=sub)
        args = ap.parse_args(argv)
        return int(args.handler(args))
    except ErdmaError as exc:
        print(f"erdma: error: {exc}", file=sys.stderr)
        return 2
    except launcher.Signalled as sig:  # what it started is stopped: now end as the signal would have
        launcher.die_of(sig.signum)
