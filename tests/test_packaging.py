"""Every distribution of the repository installs without setuptools deprecation warnings (an SPDX license
string needs setuptools 77) and depends on erdma-core within one minor version."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECTS = sorted([ROOT / "pyproject.toml", *ROOT.glob("plugins/*/pyproject.toml"),
                   *ROOT.glob("examples/*/pyproject.toml")])


@pytest.mark.parametrize("path", PROJECTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_project_metadata_is_current(path):
    data = tomllib.loads(path.read_text())
    assert data["build-system"]["requires"] == ["setuptools>=77"]
    assert isinstance(data["project"]["license"], str)  # a table is deprecated
    if data["project"]["name"] != "erdma-core":
        assert "erdma-core>=0.1,<0.2" in data["project"]["dependencies"]
