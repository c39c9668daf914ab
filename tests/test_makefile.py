"""The Makefile's install lines, as ``make -n`` prints them (nothing runs): torch comes from the index
``TORCH_INDEX`` names, and from pip's own configuration when it is empty (the default)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _torch_lines(*args: str) -> list[str]:
    out = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), ".venv/.test", ".venv/.bench", *args],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [line for line in out.splitlines() if "pip install" in line and "torch==2.13.0" in line]


def test_torch_comes_from_the_index_named_by_torch_index():
    lines = _torch_lines("TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    alone = [line for line in lines if " -e " not in line]  # torch's own install, before the rest
    assert len(alone) == 2, lines  # make test's and make bench's
    assert all("--index-url https://download.pytorch.org/whl/cpu 'torch==2.13.0'" in line for line in alone), alone
    assert all("--index-url" not in line for line in lines if " -e " in line), lines  # the rest: pip's own


def test_without_torch_index_pip_uses_its_own_configuration():
    lines = _torch_lines()
    assert len(lines) == 4 and all("--index-url" not in line for line in lines), lines


def test_make_check_builds_a_venv_of_the_core_alone_and_runs_lint_types_and_tests():
    """``make check`` (CONTRIBUTING.md): its own venv with the core and its ``check`` extra (no torch, no
    plugin, no system packages, nothing as root), then ruff, mypy on erdma_core and pytest on files that exist."""
    import tomllib

    lines = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), "check"], capture_output=True, text=True,
                           timeout=60, check=True).stdout.splitlines()
    installs = [line for line in lines if "pip install" in line]
    assert installs == [".venv-check/bin/pip install -q -e '.[check]'"], lines
    assert not any(word in line for line in lines for word in ("system-deps", "apt-get", "sudo", "torch", "plugins/"))
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["check"]
    assert not any(req.startswith(("torch", "lightning", "accelerate")) for req in extra), extra
    runs = [line for line in lines if line.startswith(".venv-check/bin/")][1:]
    assert runs[0] == ".venv-check/bin/ruff check ." and runs[1] == ".venv-check/bin/mypy erdma_core", runs
    files = runs[2].split("-p no:randomly ")[1].split()
    assert len(files) >= 15 and all((ROOT / f).is_file() for f in files), files
