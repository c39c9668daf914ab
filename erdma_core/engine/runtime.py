"""The per-process state behind every ProcessGroup of a job: config, components, store, transport, codecs."""

from __future__ import annotations

import itertools
import threading
from typing import Any

from ..algorithms.schedule import Options
from ..config import Config
from ..plugins.manager import Component, Components
from ..protocol.store import Store
from .codec_set import Codecs


class Runtime:
    def __init__(self, *, rank: int, world_size: int, config: Config, components: Components, store: Store,
                 transport: Any, job: int, codecs: Codecs) -> None:
        self.rank, self.world_size = rank, world_size
        self.config, self.components = config, components
        self.store, self.transport, self.job = store, transport, job
        self.codecs = codecs
        self.slow_links: frozenset[frozenset[int]] = frozenset()  # pairs of global ranks (``topology.agree``)
        self.paths_round = 0  # rounds of ``ProcessGroup.agree_paths`` after set-up's
        self.timeout: float = config["timeouts.collective"]
        self._groups = itertools.count(1)
        self._algorithms: dict[tuple[str, str], tuple[Component, Options]] = {}
        self._closed = False
        self._lock = threading.Lock()

    def next_group_id(self) -> int:
        with self._lock:
            return next(self._groups)

    def algorithm(self, op: str, name: str) -> tuple[Component, Options]:
        """The registered algorithm ``name`` for ``op`` and its options from ``[algorithm.<op>.<name>]``."""
        found = self._algorithms.get((op, name))
        if found is None:
            comp = self.components.algorithm(op, name)
            found = self._algorithms[(op, name)] = (comp, Options.of(self.config.section(f"algorithm.{op}.{name}")))
        return found

    @property
    def closed(self) -> bool:
        """The job's transport and store are released (the default group was destroyed)."""
        return self._closed

    def close(self) -> None:
        """Release the transport (after the peers acknowledged what was sent), the codecs and the store."""
        if self._end():
            self._release()

    def abort(self, error: BaseException) -> None:
        """Fail everything queued or in flight on the transport with ``error``, tell the peers why (bounded,
        as any abort), then release as ``close`` does, without waiting for acknowledgements."""
        if self._end():
            self.transport.abort(error)
            self._release()

    def _end(self) -> bool:
        """Mark the runtime closed: True for the one caller that does it."""
        with self._lock:
            first, self._closed = not self._closed, True
        return first

    def _release(self) -> None:
        self.transport.close()  # after an abort: no linger for acknowledgements (MessageTransport.settling)
        self.codecs.close()
        if self.rank == 0 and hasattr(self.store, "cleanup"):
            self.store.cleanup()  # a folder store must not hand this job's keys to the next one
        self.store.close()
