"""Joining a job: ``init`` reads the config, finds the other ranks (discovery), agrees on a job id, sets
up traversal and transport, and returns the default ``ProcessGroup``."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

import attrs

from .. import config as cfg
from ..engine import topology
from ..engine.codec_set import Codecs, applies, parse_ops
from ..engine.runtime import Runtime
from ..errors import AuthenticationError, CollectiveError, ConfigError, ErdmaError
from ..plugins.manager import Components, components, instantiate
from ..protocol.ops import COLLECTIVES
from ..security import auth
from ..transport.base import MessageTransport, TransportContext, failed_elsewhere, failure_key
from ..transport.paired import PairedTransport
from .process_group import ProcessGroup

log = logging.getLogger("erdma")

_default: ProcessGroup | None = None
LINGER_S = 2.0  # seconds a rank that serves the store and failed in set-up serves on, for the others to read why


def load_config(config: str | os.PathLike[str] | Mapping[str, Any] | cfg.Config | None = None,
                comps: Components | None = None, *, check: bool = True, **overrides: Any) -> cfg.Config:
    """The effective config: ``config`` is a path to erdma.toml, a dict of dotted keys, or a Config (taken as
    it is). Every value is checked against its option and (``check``) every selected component's rules
    (``check_config``): what cannot take effect is a ConfigError here, before this process contacts anyone."""
    if isinstance(config, cfg.Config):
        return config
    comps = comps or components()
    schema = cfg.core_schema({op: list(a) for op, a in comps.algorithms.items()},
                             {k: comps.names(k) for k in comps.by_kind})
    for kind, key in (("transport", "transport"), ("traversal", "traversal"), ("compressor", "compression")):
        schema[key]["name"] = attrs.evolve(schema[key]["name"], hint=comps.hint(kind))
    for op in comps.algorithms:  # [collectives] allreduce = "naca": which distribution brings an algorithm
        if op in schema["collectives"]:
            schema["collectives"][op] = attrs.evolve(schema["collectives"][op], hint=comps.hint("algorithm"))
    schema |= comps.option_sections()
    declared = {name: doc for name, (_, doc) in comps.environment.items()}
    if isinstance(config, Mapping):
        conf = cfg.build(schema, overrides={**config, **overrides}, declared_env=declared)
    else:
        conf = cfg.build(schema, file=config, overrides=overrides, declared_env=declared)
    if check:
        check_config(conf, comps)
    return conf


def check_config(conf: cfg.Config, comps: Components) -> None:
    """The rules between keys: the core's, then each selected component's (``register(..., check=)``)."""
    auth.require(conf["security.secret"].encode(), conf["security.require_secret"])
    fallback = conf["transport.fallback"]
    if fallback not in ("none", "tcp") and conf["transport.name"] != "tcp":
        raise ConfigError(f"config key 'transport.fallback': value {fallback!r} takes the pairs the built-in TCP "
                          f"cannot connect, and transport.name is {conf['transport.name']!r}; valid here: none (or "
                          "transport.name = \"tcp\")")
    if fallback != "none" and conf["traversal.name"] == "direct":
        raise ConfigError(f"config key 'transport.fallback': value {fallback!r} takes the pairs the built-in TCP "
                          "cannot meet through their NATs, and traversal.name = \"direct\" meets none (every pair "
                          "dials, and either connects or fails); valid here: none (or traversal.name = \"stun\")")
    if fallback == "tcp":
        raise ConfigError("config key 'transport.fallback': value 'tcp' is the first transport of a paired job, not "
                          "its fallback; valid: none, or a transport that carries the rest (quic)")
    if fallback != "none":
        takes = [n for n in comps.names("transport") if getattr(comps.get("transport", n).factory, "takes_peers", False)]
        if fallback not in takes:
            raise ConfigError(f"config key 'transport.fallback': value {fallback!r} connects every rank of a job and "
                              "cannot carry only the pairs another transport left; valid: none, "
                              + ", ".join(takes or ["(none installed)"]))
    compressed = parse_ops(conf["compression.ops"], True) or frozenset(COLLECTIVES)  # (a bad value raises here)
    compressed &= parse_ops(conf["compression.ops"], False) or frozenset(COLLECTIVES)  # whether lossy or not
    if conf["compression.name"] != "none":
        for op in sorted(compressed):
            name = conf.section("collectives").get(op)
            algo = comps.algorithms.get(op, {}).get(name or "")
            if algo is not None and algo.offload:
                raise ConfigError(f"config key 'collectives.{op}': value {name!r} runs through an offload (plugin "
                                  f"{algo.plugin!r}), which compression.name={conf['compression.name']!r} cannot apply "
                                  f"to; choose another algorithm, or leave {op} out of compression.ops")
    comps.check(conf)


def _env_int(name: str, given: int | None, needed_by: str) -> int:
    if given is not None:
        return given
    raw = os.environ.get(name)
    if raw is None:
        raise ConfigError(f"{needed_by}: no {name.lower()} given and {name} is not set in the environment "
                          "(set by torchrun or `erdma run`)")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def init(config: str | os.PathLike[str] | Mapping[str, Any] | cfg.Config | None = None, *,
         rank: int | None = None, world_size: int | None = None, init_method: str | None = None,
         timeout: float | None = None) -> ProcessGroup:
    """Join the job and return its default ProcessGroup. With no arguments: env:// as torchrun sets it."""
    comps = components()
    overrides: dict[str, Any] = {}
    if init_method is not None:
        overrides["discovery.init_method"] = init_method
    if timeout is not None:
        overrides["timeouts.collective"] = float(timeout)
    conf = load_config(config, comps, **overrides)
    url = conf["discovery.init_method"]
    world_size = _env_int("WORLD_SIZE", world_size, "init")
    if world_size < 1:
        raise ConfigError(f"init: world_size {world_size} is not at least 1")
    method = comps.get("discovery", urlparse(url).scheme or url)
    if rank is None and os.environ.get("RANK") is None and getattr(method.factory, "assigns_ranks", False):
        store = instantiate(method, url, None, world_size, conf["timeouts.connect"], conf)
        return init_with_store(store, store.rank, world_size, conf)  # the rank the ranks agreed on through it
    rank = _env_int("RANK", rank, "init")
    if not 0 <= rank < world_size:
        raise ConfigError(f"init: rank {rank} is not in [0, world_size={world_size})")
    store = instantiate(method, url, rank, world_size, conf["timeouts.connect"], conf)
    return init_with_store(store, rank, world_size, conf)


def init_with_store(store: Any, rank: int, world_size: int, conf: cfg.Config, *, default: bool = True) -> ProcessGroup:
    """Join the job through a store that is already up (e.g. the one torch.distributed made). ``default``: the
    group becomes the process's default one (False: a group beside it, such as an elastic path check's)."""
    global _default
    comps = components()
    connect_timeout = conf["timeouts.connect"]
    job = transport = codecs = None
    connected = False
    try:
        secret = conf["security.secret"].encode()
        job = _agree_job(store, rank, world_size, secret, connect_timeout)
        traversal = comps.create("traversal", conf["traversal.name"], conf, conf.section(
            f"traversal.{conf['traversal.name']}"))
        transport = _transport(comps, conf)
        codecs = _codecs(comps, conf, getattr(transport, "link_rate", None), rank)
        udp = getattr(traversal, "udp_socket", None)
        stream = getattr(transport, "streams", False)  # it meets peers over TCP: the traversal's TCP socket
        paired = isinstance(transport, PairedTransport)
        transport.connect(TransportContext(rank=rank, world_size=world_size, store=store, job=job,
                                           connect_timeout=connect_timeout, advertise=traversal.advertise,
                                           udp_socket=udp() if callable(udp) and not stream else None,
                                           open_udp=udp if callable(udp) and paired else None,
                                           tcp_socket=getattr(traversal, "tcp_socket", None) if stream else None,
                                           secret=secret, punch=getattr(traversal, "punch", None),
                                           udp_sockets=getattr(traversal, "udp_sockets", None),
                                           candidates=getattr(traversal, "candidates", None),
                                           dial_plan=getattr(traversal, "dial_plan", None),
                                           max_early_bytes=conf["security.max_early_bytes"],
                                           collective_timeout=conf["timeouts.collective"]))
        connected = True
        _check_unique(store, job, rank)
        slow_peers = getattr(transport, "slow_peers", None)
        mine = slow_peers() if callable(slow_peers) else None
        slow = topology.agree(store, rank, world_size, mine, connect_timeout) if mine is not None else frozenset()
        _set_up(store, job, rank, world_size, min(SET_UP_WAIT_S, connect_timeout))
    except BaseException as exc:
        if job is not None:
            _gave_up(store, job, rank, exc, min(LINGER_S, connect_timeout))
        if connected:  # its peers are told, and its connections, sockets and threads are given back now
            _release(transport, exc)
        if codecs is not None:
            codecs.close()
        store.close()
        raise
    rt = Runtime(rank=rank, world_size=world_size, config=conf, components=comps, store=store, transport=transport,
                 job=job, codecs=codecs)
    rt.slow_links = slow
    pg = ProcessGroup(rt, range(world_size), 0)
    fallback = conf["transport.fallback"]
    log.info("rank %d of %d: transport %s%s, allreduce %s, %s", rank, world_size, conf["transport.name"],
             f" ({fallback} for the pairs it cannot connect)" if fallback != "none" else "",
             conf["collectives.allreduce"], applies(codecs))
    if default:
        _default = pg
    return pg


def _release(transport: Any, error: BaseException) -> None:
    """A transport that connected, in a set-up that failed after it: it aborts (the peers learn why) and
    closes; what that raises is logged, the set-up's own error is what the caller gets."""
    try:
        transport.abort(error)
        transport.close()
    except Exception as exc:
        log.debug("init: releasing the transport of a failed set-up: %s", exc)


def _transport(comps: Components, conf: cfg.Config) -> Any:
    """The configured transport; with ``transport.fallback``, the pair of them (``PairedTransport``)."""
    name, fallback = conf["transport.name"], conf["transport.fallback"]
    first = comps.create("transport", name, conf, conf.section(f"transport.{name}"))
    if fallback == "none":
        return first
    second = comps.create("transport", fallback, conf, conf.section(f"transport.{fallback}"))
    for t, role in ((first, "name"), (second, "fallback")):
        if not isinstance(t, MessageTransport):
            raise ConfigError(f"config key 'transport.{role}': value {conf[f'transport.{role}']!r} is not a message "
                              "transport (erdma_core.toolkit.MessageTransport), which a paired job needs on both sides; "
                              "valid here: transport.name = \"tcp\", transport.fallback = \"quic\"")
    return PairedTransport(first, second)


def _codecs(comps: Components, conf: cfg.Config, link_rate: Any = None, rank: int = 0) -> Codecs:
    """The configured compressor for sending; any installed one, made on first use, for receiving."""
    made: dict[int, Any] = {}

    def make(comp: Any) -> Any:
        return instantiate(comp, conf, conf.section(comp.section))

    def lookup(codec: int) -> Any:
        comp = comps.codecs.get(codec)
        if comp is None:
            return None
        if codec not in made:
            made[codec] = make(comp)
        return made[codec]

    name = conf["compression.name"]
    sender = None if name == "none" else make(comps.get("compressor", name))
    ops = parse_ops(conf["compression.ops"], bool(sender is not None and sender.lossy))
    auto = conf["compression.policy"] == "auto"
    return Codecs(sender, conf["compression.min_bytes"], lookup, ops, link_rate if auto else None,
                  conf["compression.pipeline"], rank)


def _agree_job(store: Any, rank: int, world_size: int, secret: bytes, timeout: float) -> int:
    """All ranks agree on a 64-bit job id (rank 0 draws it) and on the world size, through the store. Rank 0
    signs what it publishes with the secret, so that a rank started with another secret says so even over a
    store that does not authenticate (torch's, a shared folder)."""
    if rank == 0:
        job = secrets.randbits(64)
        store.set("erdma/job", f"{job}:{world_size}:{_sign(secret, job, world_size)}".encode())
    raw = store.get("erdma/job", timeout).decode()
    try:
        got_job, got_world, mac = raw.split(":")
        job, got = int(got_job), int(got_world)
    except ValueError:
        raise ErdmaError(f"rank {rank}: the store's erdma/job entry {raw[:80]!r} is not rank 0's") from None
    if not hmac.compare_digest(mac, _sign(secret, job, got)):
        raise _tell(store, job, AuthenticationError(
            f"rank {rank}: rank 0's job entry is not signed with this rank's security.secret (the ranks were "
            "started with different secrets)"))
    if got != world_size:
        raise _tell(store, job, ConfigError(f"rank {rank}: world_size {world_size} disagrees with rank 0's {got}"))
    if store.add(_joined(job, rank), 1) > 1:  # per job id: a store used again for a new job starts afresh
        raise ConfigError(_duplicate(rank))
    return job


SET_UP_WAIT_S = 5.0  # how long rank 0 waits, at the end of set-up, for the others to be done with the store


def _joined(job: int, rank: int) -> str:
    return f"erdma/joined/{job:016x}/{rank}"


def _gave_up(store: Any, job: int, rank: int, exc: BaseException, linger: float) -> None:
    """This rank's set-up failed with ``exc``. Its own reason (its config, a plugin, a STUN server, a credential;
    not a peer it lost or waited for in vain, which the others see for themselves) goes to the store unless
    another rank's came first, so that the others' set-up ends with it at once; a rank that serves the store
    serves on (``linger`` seconds at most) until they have read it."""
    told = failed_elsewhere(store, job) is not None
    if not told and isinstance(exc, Exception) and not isinstance(exc, CollectiveError):
        said = str(exc) if isinstance(exc, ErdmaError) else f"{type(exc).__name__}: {exc}"
        _tell(store, job, ErdmaError(said if said.startswith(f"rank {rank}") else f"rank {rank}: {said}"))
        told = True
    serving = getattr(store, "linger", None)
    if told and callable(serving):
        serving(linger)


def _tell(store: Any, job: int, error: Exception) -> Exception:
    """This rank cannot take part: say so in the store, where the others' set-up looks (``failed_elsewhere``)."""
    try:
        store.set(failure_key(job), str(error).encode()[:4096])
    except Exception:  # the store is best effort here; the error itself is raised anyway
        pass
    return error


def _sign(secret: bytes, job: int, world: int) -> str:
    return hmac.new(secret, f"erdma job {job}:{world}".encode(), hashlib.sha256).hexdigest()


def _duplicate(rank: int) -> str:
    return f"rank {rank}: another process already joined this job as rank {rank} (duplicate rank)"


def _set_up(store: Any, job: int, rank: int, world_size: int, wait: float) -> None:
    """Each rank says it is done with the store's set-up keys; rank 0, which may serve the store and end the
    job first (a root that sends and leaves), waits for every rank's word (at most ``wait`` seconds: a rank
    lost meanwhile is found by the first collective), so that no rank still in set-up finds the store gone."""
    key = f"erdma/set-up/{job:016x}"
    done = store.add(key, 1)
    end, pause = time.monotonic() + wait, 0.005
    while rank == 0 and done < world_size and time.monotonic() < end:
        time.sleep(pause)  # a round trip each look: doubling up to 0.1 s, not a busy poll of the store
        pause = min(2 * pause, 0.1)
        done = store.add(key, 0)


def _check_unique(store: Any, job: int, rank: int) -> None:
    """After set-up: a second process that joined with this rank meanwhile makes the first one fail too."""
    if store.add(_joined(job, rank), 0) > 1:
        raise ConfigError(_duplicate(rank))


def default_group() -> ProcessGroup:
    if _default is None:
        raise ErdmaError("erdma_core.init() has not been called in this process")
    return _default


def new_group(ranks: list[int] | None = None) -> ProcessGroup | None:
    return default_group().new_group(ranks)
