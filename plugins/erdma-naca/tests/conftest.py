"""Aggregation nodes as real processes (``erdma naca serve``) and the settings that point ranks at them."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from erdma_naca.serve import address_of

os.environ["ERDMA_PLUGINS"] = "naca"  # the core's test worlds load only the plugins they are told to


class Node:
    def __init__(self, secret_file: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "erdma_core.cli", "naca", "serve", "--host", "127.0.0.1", "--port", "0",
             "--secret-file", str(secret_file), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.address = address_of(self.proc)
        self.port = int(self.address.rsplit(":", 1)[1])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> str:
        """SIGTERM; the node's closing line (its counters)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        return out


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "naca.secret"
    path.write_text(secrets.token_hex(32))
    return path


@pytest.fixture
def start_node(secret_file: Path) -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def start(*args: str, secret: Path | None = None) -> Node:
        node = Node(secret or secret_file, *args)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        if node.proc.poll() is None:
            node.kill()
        for stream in (node.proc.stdout, node.proc.stderr):
            if stream is not None:
                stream.close()


def naca_config(nodes: list[Any], secret_file: Path, **extra: Any) -> dict[str, Any]:
    """A World config that runs allreduce, broadcast and reduce_scatter through ``nodes``."""
    cfg = {"collectives.allreduce": "naca", "collectives.broadcast": "naca", "collectives.reduce_scatter": "naca",
           "algorithm.allreduce.naca.nodes": ",".join(n if isinstance(n, str) else n.address for n in nodes),
           "algorithm.allreduce.naca.secret_file": str(secret_file), "timeouts.collective": 60.0}
    cfg.update({f"algorithm.allreduce.naca.{k}": v for k, v in extra.items()})
    return cfg
