"""torchft's fault-tolerant process group on eRDMA.

    from erdma_core.torchft import ProcessGroupErdma
    manager = torchft.Manager(pg=ProcessGroupErdma(), min_replica_size=1, ...)

torchft's Manager forms a quorum of replica groups for each step and, when it changes (a replica died or
joined), reconfigures the group: it aborts the old one and asks ``_create_pg(store, rank, world)`` for a new
one on a fresh store, which makes an eRDMA group there (the pipeline ``erdma.toml`` chooses: transport,
algorithms, compression). ``abort()`` releases the old group's threads and connections at once, and an op
pending on it fails on every peer, so the Manager discards that step instead of waiting for a timeout.
``examples/torchft_ddp.py`` runs a DDP job that survives a killed and restarted replica. Needs the
``torchft`` package (``pip install torchft-nightly``); importing this module imports it.
"""

from __future__ import annotations

from typing import Any

from torchft.process_group import ProcessGroupWrapper

from .torch import create


class ProcessGroupErdma(ProcessGroupWrapper):
    """torchft's reconfigurable group whose every configuration is an eRDMA group (as torchft's
    ``ProcessGroupGloo`` is for Gloo). Its ``timeout`` (torchft's, default 60 s) is each one's set-up and
    collective timeout, unless ``timeouts.collective`` is configured."""

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        return create(store, rank, world_size, self._timeout)

    def getBackendName(self) -> str:
        return "torchft-erdma"
