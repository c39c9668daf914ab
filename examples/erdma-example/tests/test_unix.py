"""The Unix transport passes the conformance suite every transport's tests subclass."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import numpy as np

from erdma_core.testing.conformance import TransportConformance


class TestUnixTransport(TransportConformance):
    transport = "unix"


def where_are_the_sockets(pg: Any) -> list[str]:
    a = np.ones(4)
    pg.allreduce(a)
    folder = pg.transport.folder
    return sorted(f for f in os.listdir(folder) if f.endswith(".sock"))


class TestUnixTransportInAFolder(TransportConformance):
    transport = "unix"
    config: ClassVar[dict[str, Any]] = {"collectives.chunk_bytes": 65536}

    def test_sockets_live_in_the_configured_folder(self, erdma_world: Any, tmp_path: Any) -> None:
        world = erdma_world(3, {"transport.name": "unix", "transport.unix.folder": str(tmp_path)})
        names = world.run(where_are_the_sockets)
        assert len(names[0]) == 3 and all(n == names[0] for n in names)
        world.close()
        assert os.listdir(tmp_path) == []  # each rank removes its socket at close
