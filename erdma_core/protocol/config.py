"""What a component is given of the job's config: the effective values, read-only."""

from __future__ import annotations

from typing import Any, Protocol


class Config(Protocol):
    """The job's effective config (defaults < file < environment < arguments), read-only. Keys are dotted
    (``"transport.name"``, ``"transport.quic.workers"``); an unknown key raises ``KeyError``."""

    def __getitem__(self, key: str) -> Any:
        """One value, typed as its ``Option`` declares."""
        ...

    def section(self, name: str) -> dict[str, Any]:
        """The values of one section (``"transport.tcp"``), keyed by the part after it (``"port"``)."""
        ...
