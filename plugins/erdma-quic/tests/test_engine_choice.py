"""``transport.quic.engine``: ``auto`` (the default) takes the compiled engine where erdma-quic was built with
it and aioquic otherwise, saying what to install; naming ``ngtcp2`` where it was not built is an error that
says the same."""

from __future__ import annotations

import logging
import multiprocessing as mp
import sys
from pathlib import Path
from typing import Any

import pytest
from erdma_quic import transport
from erdma_quic.aioquic_engine import AioquicConnection
from erdma_quic.ngtcp2.connection import loaded
from erdma_quic.ngtcp2.mesh_connection import EngineFactory
from helpers import options

from erdma_core.sdk import PluginError

PACKAGES = "apt-get install libngtcp2-dev libngtcp2-crypto-gnutls-dev libgnutls28-dev"


@pytest.mark.skipif(loaded() is None, reason="the compiled engine is not built here (test_engine says why)")
def test_auto_takes_the_compiled_engine_where_it_was_built() -> None:
    made = transport.connection_for(options(engine="auto"))
    assert isinstance(made, EngineFactory)
    other = transport.connection_for(options(engine="auto"))  # another endpoint: keys and table of its own
    assert made.tickets is not other.tickets and made.demux is not other.demux
    assert transport.connection_for(options(engine="aioquic")) is AioquicConnection


def test_without_the_build_auto_runs_on_aioquic_and_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "erdma_quic.ngtcp2._shim", None)
    transport._warn_no_engine.cache_clear()
    with caplog.at_level(logging.WARNING, logger="erdma.quic"):
        assert transport.connection_for(options(engine="auto")) is AioquicConnection
        assert transport.engine_name(options(engine="auto")) == "aioquic"
    warned = [r.getMessage() for r in caplog.records if "engine = auto" in r.getMessage()]
    assert len(warned) == 1 and PACKAGES in warned[0], caplog.text  # once per process
    with pytest.raises(PluginError, match=PACKAGES):
        transport.connection_for(options(engine="ngtcp2"))
    transport._warn_no_engine.cache_clear()


def _join(rank: int, engine: str, url: str, out: Any) -> None:
    import erdma_core

    try:
        pg = erdma_core.init({"transport.name": "quic", "transport.quic.engine": engine, "timeouts.connect": 30.0,
                              "security.secret": "engines"}, rank=rank, world_size=2, init_method=url)
        pg.destroy()
        out.put((rank, "joined", ""))
    except Exception as exc:
        out.put((rank, type(exc).__name__, str(exc)))


@pytest.mark.skipif(loaded() is None, reason="the compiled engine is not built here (test_engine says why)")
def test_ranks_on_different_engines_both_fail_at_set_up_naming_both(tmp_path: Path) -> None:
    """The engines frame messages differently: a job whose ranks run both is refused at set-up, on every
    rank, by a ConfigError that names the key and both engines (not a handshake that fails without a why)."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_join, args=(r, e, f"file://{tmp_path}/store", out))
             for r, e in ((0, "ngtcp2"), (1, "aioquic"))]
    for p in procs:
        p.start()
    got = dict((r, (kind, msg)) for r, kind, msg in (out.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(10)
    said = ("config key 'transport.quic.engine': rank 1 runs the aioquic engine and rank 0 the ngtcp2 engine; they "
            "frame messages differently, so every rank must run the same one")
    assert got[1][0] == "ConfigError" and said in got[1][1], got
    assert got[0][0] != "joined" and said in got[0][1], got  # rank 0, which dials no one, is told why
