"""Elastic groups: peers join and leave a running job; the members go on with bit-identical state.

    from erdma_core import elastic
    group = elastic.join({"params": params, "momentum": m})    # waits to be admitted, receives the state
    while group.step < steps:
        group.sync()                       # step boundary: newcomers admitted here get the state
        delta = ...inner steps, locally...
        if group.allreduce(delta) == 0:    # average over the members; survives a member's death
            continue                       # this peer was counted out and came back with the members' state
        ...apply delta to params...
        group.step += 1
    group.finish()                         # peers still waiting to be admitted get JobFinishedError

Membership is agreed through the job's store (``compare_set``), with no master: see ``membership``. The
static ``ProcessGroup`` is unchanged; each epoch of an elastic group has one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from ..api.join import load_config
from ..discovery import env_store, etcd_store, file_store, tcp_store
from ..errors import ConfigError
from .founding import found
from .group import ElasticGroup
from .membership import CasStore, ExcludedError, JobFinishedError
from .peer_store import PeerStore

__all__ = [
    "ElasticGroup", "ExcludedError", "JobFinishedError", "found", "join", "open_bulletin", "open_store",
]  # found: write a job's first epoch on its store, as ``erdma run --elastic`` does


def open_bulletin(url: str, conf: Any) -> Any:
    """A client of the DHT at ``url`` (``dht://``, the p2p plugin's discovery) as an elastic job's bulletin."""
    from ..plugins.manager import components, instantiate

    comps = components()
    if "dht" not in comps.names("discovery"):
        raise ConfigError(f"config key 'discovery.init_method': {url!r} needs the dht discovery of erdma-p2p "
                          "(pip install erdma-p2p)")
    return instantiate(comps.get("discovery", "dht"), url, -1, 0, conf["timeouts.connect"], conf)


def open_peer_store(url: str, conf: Any) -> PeerStore:
    """A store with no server for ``dht://``: the p2p plugin's DHT as the bulletin, the members deciding among
    themselves over their mesh (``peer_store``)."""
    from ..net import addresses

    bulletin = open_bulletin(url, conf)
    try:
        towards = urlparse(url).netloc.split(",")[0].rsplit(":", 1)[0]
        host, advertised = addresses.choose(conf["transport.tcp.bind_address"], conf["transport.tcp.interface"],
                                            towards)
        return PeerStore(bulletin, conf["security.secret"].encode(), conf["elastic.job"], host=host,
                         advertise=advertised, towards=towards)
    except BaseException:
        bulletin.close()
        raise


def open_store(url: str, conf: Any) -> CasStore:
    """A client of the store at ``url`` (env://, tcp://HOST:PORT, file:///PATH or etcd://...), made by the built-in
    discovery method as a rank other than 0 would make it: an elastic job's store is served by something that
    outlives its peers (``erdma run --elastic``), never by a peer."""
    methods = {"env": env_store, "tcp": tcp_store, "file": file_store, "etcd": etcd_store}
    method = methods.get(urlparse(url).scheme)
    if method is None:
        raise ConfigError(f"config key 'discovery.init_method': {url!r} cannot hold an elastic job's membership; "
                          "valid: env://, tcp://HOST:PORT, file:///PATH, etcd://HOST:PORT[,HOST:PORT...]/PREFIX, "
                          "dht://HOST:PORT[,HOST:PORT...]/JOB (erdma-p2p)")
    return method(url, -1, 0, conf["timeouts.connect"], conf)  # type: ignore[return-value]  # -1: not the server


def join(state: Mapping[str, Any], config: Any = None, *, announce: bool = True) -> ElasticGroup:
    """Join the elastic job ``elastic.job`` sharing ``state``; return once this peer is a member holding the
    members' state. The job starts when ``elastic.min_peers`` peers have joined; later peers are admitted at
    the members' next step boundary (waiting at most ``elastic.join_timeout``). ``config``: as ``init``'s.
    ``announce``: the member of rank 0 prints each new membership to stderr."""
    conf = load_config(config)
    if 0 < conf["elastic.liveness_timeout"] < 0.5:
        raise ConfigError(f"config key 'elastic.liveness_timeout': {conf['elastic.liveness_timeout']!r} would have "
                          "every member write to the store more than 8 times a second; valid: 0 (off) or at least 0.5")
    url = conf["discovery.init_method"]
    if urlparse(url).scheme == "dht":
        peers = open_peer_store(url, conf)
        group = ElasticGroup(peers, conf, conf["elastic.job"], state, min_peers=conf["elastic.min_peers"],
                             join_timeout=conf["elastic.join_timeout"], announce=announce,
                             beats=peers.signs() if conf["elastic.liveness_timeout"] > 0 else None,  # type: ignore[arg-type]
                             clients=lambda: _Unclosed(peers))
        group.sync()
        return group
    store = open_store(url, conf)
    beats = open_store(url, conf) if conf["elastic.liveness_timeout"] > 0 else None
    group = ElasticGroup(store, conf, conf["elastic.job"], state, min_peers=conf["elastic.min_peers"],
                         join_timeout=conf["elastic.join_timeout"], announce=announce, beats=beats,
                         clients=lambda: open_store(url, conf))
    group.sync()
    return group


class _Unclosed:
    """The peer store as a path check's client (``admission``): its ``close`` leaves the store open."""

    def __init__(self, store: PeerStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def close(self) -> None:
        pass
