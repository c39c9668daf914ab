"""The traversal interface, and the built-in ``direct`` strategy (no NAT traversal)."""

from __future__ import annotations

from typing import Any, Protocol


class Traversal(Protocol):
    def advertise(self, host: str, port: int) -> tuple[str, int]:
        """Given the address this rank listens on, return the address peers should dial."""
        ...


class DirectTraversal:
    """No NAT traversal: peers dial the address this rank listens on."""

    def __init__(self, config: Any = None, section: dict[str, Any] | None = None) -> None:
        pass

    def advertise(self, host: str, port: int) -> tuple[str, int]:
        return host, port
