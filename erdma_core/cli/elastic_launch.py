"""``erdma run --elastic``: serve an elastic job's store (or, with ``--store etcd://...``, keep it on an etcd
cluster) and start N local peers that keep going when one exits; ``erdma run --join HOST:PORT|URL``: add peers
to such a job from another shell or machine."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..discovery.store import TCPStore
from ..errors import ConfigError
from .launcher import Signalled, Stopping, free_port, local_env, spawn, stop, stops_on_signals


def read_secret(path: str) -> str:
    try:
        secret = open(path, encoding="utf-8").read().strip()
    except OSError as exc:
        raise ConfigError(f"erdma run: --secret-file {path!r} cannot be read: {exc.strerror}") from None
    if not secret:
        raise ConfigError(f"erdma run: --secret-file {path!r} is empty")
    return secret


def _write_secret(secret: str, port: int) -> str:
    fd, path = tempfile.mkstemp(prefix=f"erdma-elastic-{port}-", suffix=".secret")  # 0600
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return path


def run(nprocs: int, cmd: Sequence[str], *, config: str | None, join: str | None, host: str, port: int,
        secret_file: str | None, prefix: bool, timeout: float | None, store_url: str | None = None) -> int:
    """Start ``nprocs`` peers of ``cmd``; return 0 once one of them finished well, else the first failure's code.
    Without ``join``: serve the job's store on ``host:port`` (0: a free port) for as long as a peer runs, or,
    with ``store_url`` (etcd://...), keep it under a new job id on that cluster, where it outlives this
    process (and so does the secret file written for it)."""
    if nprocs < 1:
        raise ValueError(f"-n must be at least 1, got {nprocs}")
    secret = read_secret(secret_file) if secret_file else (
        os.environ.get("ERDMA_SECRET") or os.environ.get("ERDMA_SECURITY_SECRET") or "")
    env = local_env(os.environ, nprocs, config)
    pumps: list[threading.Thread] = []
    store: TCPStore | None = None
    written: str | None = None
    if join is None and store_url is not None:
        secret = secret or secrets.token_hex(32)
        where = _replicated(store_url, secret, config, nprocs)
        path = secret_file or _write_secret(secret, 0)  # kept: the job may go on after this process
        sys.stderr.write(f"erdma run: elastic job's store on {where}; add a peer from another shell with\n"
                         f"  erdma run --join {where} --secret-file {path} -n 1 -- {' '.join(cmd)}\n")
        env["ERDMA_ELASTIC_MIN_PEERS"] = str(nprocs)
    elif join is None:
        secret = secret or secrets.token_hex(32)
        port = port or free_port()
        store = TCPStore(host, port, is_server=True, timeout=10.0, secret=secret.encode())
        _start_at(store, _job(config), nprocs)
        written = None if secret_file else _write_secret(secret, port)
        path = secret_file or written or ""
        where = f"{socket.gethostname() if host in ('', '0.0.0.0') else host}:{port}"  # what other machines dial
        sys.stderr.write(f"erdma run: elastic job's store on {where}; add a peer from another shell with\n"
                         f"  erdma run --join {where} --secret-file {path} -n 1 -- {' '.join(cmd)}\n")
        env["ERDMA_ELASTIC_MIN_PEERS"] = str(nprocs)
    else:
        where = join
        if not secret:
            raise ConfigError("erdma run --join: give the job's secret (--secret-file, as `erdma run --elastic` "
                              "printed it, or ERDMA_SECRET)")
    if "://" in where:
        if not where.startswith(("etcd://", "dht://")):
            raise ConfigError(f"erdma run: --join {where!r}: a store URL is etcd://HOST:PORT[,HOST:PORT...]/PREFIX "
                              "or dht://HOST:PORT[,HOST:PORT...]/JOB (or give HOST:PORT of a store `erdma run "
                              "--elastic` serves)")
        env |= {"ERDMA_DISCOVERY_INIT_METHOD": where, "ERDMA_SECRET": secret}
    else:
        addr, _, p = where.rpartition(":")
        if not addr or not p.isdigit():
            raise ConfigError(f"erdma run: --join {where!r} is not HOST:PORT or etcd://...")
        env |= {"MASTER_ADDR": addr, "MASTER_PORT": p, "ERDMA_SECRET": secret}
    label = "peer" if join is None else "joined peer"
    procs: list[subprocess.Popen[bytes]] = []
    with stops_on_signals() as stopping:
        try:
            for k in range(nprocs):
                stopping.check()
                proc, threads = spawn(list(cmd), {**os.environ, **env}, f"[{label} {k}] " if prefix else None)
                procs.append(proc)
                pumps += threads
            code = _watch(procs, timeout, stopping)
            for t in pumps:
                t.join(2.0)
        except Signalled as sig:
            sys.stderr.write(f"erdma run: got {sig}; stopping the peers"
                             + ("" if store is None else " and the job's store") + "\n")
            raise
        finally:
            stop(procs)
            if store is not None:
                store.close()  # the job ends with its store: the secret written for it goes too
            if written is not None:
                os.unlink(written)
    return code


def _start_at(store: Any, job: str, nprocs: int) -> None:
    """The job starts once ``nprocs`` peers joined, whoever comes first: written before any peer can join, so
    that a peer added with ``--join`` (which sets no ``elastic.min_peers``) never starts it alone."""
    from ..elastic.membership import Keys

    store.compare_set(Keys(job)("min_peers"), b"", str(nprocs).encode())


def _job(config: str | None) -> str:
    from ..api.join import load_config

    return str(load_config(config)["elastic.job"])


def _replicated(url: str, secret: str, config: str | None, nprocs: int) -> str:
    """``url`` with a new job id under its prefix, once the cluster answered there, and the job's start
    (``_start_at``) written (a ConfigError names what is wrong with the URL, an ErdmaError which member said
    what)."""
    from ..api.join import load_config
    from ..elastic import open_store

    if url.startswith("dht://"):
        return _founded(url, secret, config, nprocs)
    if not url.startswith("etcd://"):
        raise ConfigError(f"erdma run: --store {url!r}: valid: etcd://HOST:PORT[,HOST:PORT...]/PREFIX (an etcd "
                          "cluster), dht://HOST:PORT[,HOST:PORT...]/JOB (a DHT, erdma-p2p: no store at all); "
                          "without --store this process serves the job's store")
    where = f"{url.rstrip('/')}/{secrets.token_hex(6)}"
    secret_key: dict[str, Any] = {"security.secret": secret}
    conf = load_config(config, **secret_key)
    store = open_store(where, conf)
    try:
        _start_at(store, conf["elastic.job"], nprocs)
    finally:
        store.close()
    return where


def _founded(url: str, secret: str, config: str | None, nprocs: int) -> str:
    """``url`` with a new job name (``JOB-<hex>``), whose first epoch this process writes as its creator
    (``elastic.founding``) on a thread, once ``nprocs`` peers drew tickets; the records stay in the DHT after
    this process."""
    from ..api.join import load_config
    from ..elastic import open_bulletin
    from ..elastic.founding import found

    where = f"{url.rstrip('/')}-{secrets.token_hex(6)}"
    secret_key: dict[str, Any] = {"security.secret": secret}
    conf = load_config(config, **secret_key)
    bulletin = open_bulletin(where, conf)

    def creator() -> None:
        try:
            found(bulletin, conf["elastic.job"], nprocs, conf["elastic.join_timeout"])
        except Exception as exc:  # (said; the peers then time out waiting to be admitted, saying so too)
            sys.stderr.write(f"erdma run: the job's first epoch was not written: {exc}\n")
        finally:
            getattr(bulletin, "detach", bulletin.close)()

    threading.Thread(target=creator, name="erdma-elastic-creator", daemon=True).start()
    return where


def _watch(procs: list[subprocess.Popen[bytes]], timeout: float | None, stopping: Stopping) -> int:
    """Report each peer's exit and keep the others going; 0 when a peer finished well; ``Signalled`` once
    ``stopping`` noted a signal."""
    deadline = None if timeout is None else time.monotonic() + timeout
    seen: set[int] = set()
    codes: list[int] = []
    while len(seen) < len(procs):
        stopping.check()
        for k, p in enumerate(procs):
            c = p.poll()
            if c is not None and k not in seen:
                seen.add(k)
                codes.append(c)
                sys.stderr.write(f"erdma run: peer {k} exited with code {c}; {len(procs) - len(seen)} of "
                                 "this run's peers still running\n")
        if deadline is not None and time.monotonic() > deadline:
            stop(procs)
            sys.stderr.write("erdma run: the run timed out; stopped the peers\n")
            return 124
        time.sleep(0.1)
    if 0 in codes:
        return 0
    bad = next(c for c in codes if c)
    return bad if bad > 0 else 128 - bad
