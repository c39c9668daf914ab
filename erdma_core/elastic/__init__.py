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

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from ..api.join import load_config
from ..discovery.store import FileStore, TCPStore
from ..errors import ConfigError
from .group import ElasticGroup
from .membership import ExcludedError, JobFinishedError

__all__ = ["ElasticGroup", "ExcludedError", "JobFinishedError", "join", "open_store"]


def open_store(url: str, secret: bytes, timeout: float) -> Any:
    """A client of the store at ``url`` (tcp://host:port, env:// as MASTER_ADDR/MASTER_PORT, file:///path).
    An elastic job's store is served by something that outlives its peers (``erdma run --elastic``), never by
    a peer."""
    parsed = urlparse(url)
    if parsed.scheme == "env":
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            raise ConfigError("elastic: init_method 'env://' needs MASTER_ADDR and MASTER_PORT (set by "
                              "`erdma run --elastic`)")
        return TCPStore(host, int(port), is_server=False, timeout=timeout, secret=secret)
    if parsed.scheme == "tcp" and parsed.hostname and parsed.port:
        return TCPStore(parsed.hostname, parsed.port, is_server=False, timeout=timeout, secret=secret)
    if parsed.scheme == "file" and parsed.path:
        return FileStore(parsed.path)
    raise ConfigError(f"config key 'discovery.init_method': {url!r} cannot hold an elastic job's membership; "
                      "valid: env://, tcp://HOST:PORT, file:///PATH")


def join(state: Mapping[str, Any], config: Any = None, *, announce: bool = True) -> ElasticGroup:
    """Join the elastic job ``elastic.job`` sharing ``state``; return once this peer is a member holding the
    members' state. The job starts when ``elastic.min_peers`` peers have joined; later peers are admitted at
    the members' next step boundary (waiting at most ``elastic.join_timeout``). ``config``: as ``init``'s.
    ``announce``: the member of rank 0 prints each new membership to stderr."""
    conf = load_config(config)
    store = open_store(conf["discovery.init_method"], conf["security.secret"].encode(), conf["timeouts.connect"])
    group = ElasticGroup(store, conf, conf["elastic.job"], state, min_peers=conf["elastic.min_peers"],
                         join_timeout=conf["elastic.join_timeout"], announce=announce)
    group.sync()
    return group
