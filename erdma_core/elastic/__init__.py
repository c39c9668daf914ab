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
from .group import ElasticGroup
from .membership import CasStore, ExcludedError, JobFinishedError

__all__ = ["ElasticGroup", "ExcludedError", "JobFinishedError", "join", "open_store"]


def open_store(url: str, conf: Any) -> CasStore:
    """A client of the store at ``url`` (env://, tcp://HOST:PORT, file:///PATH or etcd://...), made by the built-in
    discovery method as a rank other than 0 would make it: an elastic job's store is served by something that
    outlives its peers (``erdma run --elastic``), never by a peer."""
    methods = {"env": env_store, "tcp": tcp_store, "file": file_store, "etcd": etcd_store}
    method = methods.get(urlparse(url).scheme)
    if method is None:
        raise ConfigError(f"config key 'discovery.init_method': {url!r} cannot hold an elastic job's membership; "
                          "valid: env://, tcp://HOST:PORT, file:///PATH, etcd://HOST:PORT[,HOST:PORT...]/PREFIX")
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
    store = open_store(conf["discovery.init_method"], conf)
    beats = open_store(conf["discovery.init_method"], conf) if conf["elastic.liveness_timeout"] > 0 else None
    url = conf["discovery.init_method"]
    group = ElasticGroup(store, conf, conf["elastic.job"], state, min_peers=conf["elastic.min_peers"],
                         join_timeout=conf["elastic.join_timeout"], announce=announce, beats=beats,
                         clients=lambda: open_store(url, conf))
    group.sync()
    return group
