"""Ranks of one job as QuicTransport objects in threads of this process, sharing an in-memory store."""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from erdma_quic.plugin import OPTIONS
from erdma_quic.streams import ALPNS
from erdma_quic.transport import QuicTransport, engine_name

from erdma_core.sdk import TransportContext


class MemoryStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key: str, timeout: float) -> bytes:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout):
                raise TimeoutError(key)
            return self.data[key]


def options(**kw: Any) -> dict[str, Any]:
    """The transport's defaults with ``kw``; ERDMA_TRANSPORT_QUIC_ENGINE picks the engine, as in a config."""
    opts = {k: o.default for k, o in OPTIONS.items()}
    opts["engine"] = os.environ.get("ERDMA_TRANSPORT_QUIC_ENGINE", opts["engine"])
    opts.update(kw)
    return opts


def start(rank: int, world: int, store: MemoryStore, job: int, opts: dict[str, Any],
          timeout: float = 10.0, udp_socket: Any = None,
          secret: bytes = b"", **ctx: Any) -> tuple[QuicTransport, threading.Thread, list[BaseException]]:
    """Connect one rank in a thread; ``errors`` receives what ``connect`` raised. ``ctx``: more
    ``TransportContext`` fields (a traversal's ``advertise``, ``punch``, ``udp_sockets``)."""
    t = QuicTransport(None, opts)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            t.connect(TransportContext(rank=rank, world_size=world, store=store, job=job, connect_timeout=timeout,
                                       udp_socket=udp_socket, secret=secret, **ctx))
        except BaseException as exc:
            errors.append(exc)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return t, th, errors


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


class _Watch(QuicConnectionProtocol):
    closed: events.ConnectionTerminated | None = None

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.ConnectionTerminated):
            self.closed = event
        super().quic_event_received(event)


def job_alpn() -> str:
    """The ALPN of the engine ``options()`` picks: what a stranger must announce to reach a rank's checks."""
    return ALPNS[engine_name(options())]


def raw_dial(addr: str, cert: Any = None, key: Any = None, hello: bytes = b"") -> events.ConnectionTerminated | None:
    """An outsider with plain aioquic: dial, present ``cert`` (or none), skip checking the listener, send
    ``hello`` on a stream, and return how the listener ended the connection (None: it did not)."""
    host, port = addr.rsplit(":", 1)

    made: list[_Watch] = []

    def protocol(*a: Any, **kw: Any) -> _Watch:
        made.append(_Watch(*a, **kw))
        return made[-1]

    async def go() -> None:
        cfg = QuicConfiguration(is_client=True, alpn_protocols=[job_alpn()], verify_mode=ssl.CERT_NONE)
        if cert is not None:
            cfg.certificate, cfg.private_key = cert, key
        async with asyncio.timeout(10):
            async with connect(host, int(port), configuration=cfg, create_protocol=protocol) as client:
                if hello:
                    sid = client._quic.get_next_available_stream_id(is_unidirectional=True)
                    client._quic.send_stream_data(sid, hello, end_stream=True)
                    client.transmit()
                while made[0].closed is None:
                    await asyncio.sleep(0.05)

    try:
        asyncio.run(go())
    except (ConnectionError, TimeoutError):
        pass
    return made[0].closed if made else None
