"""Every test world of this plugin authenticates with a CA made here, like `erdma keys init` makes one."""

from __future__ import annotations

from pathlib import Path

import pytest
from erdma_quic import credentials as cred


@pytest.fixture(scope="session")
def ca_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return cred.write_authority(cred.new_authority(), tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="session")
def quic_config(ca_files: tuple[Path, Path]) -> dict[str, object]:
    return {"transport.name": "quic", "transport.quic.ca_cert": str(ca_files[0]),
            "transport.quic.ca_key": str(ca_files[1])}
