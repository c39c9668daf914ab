"""The documentation is code that runs: README's Python blocks run as 2-rank jobs, its TOML blocks are valid
configs, and every file docs/plugins.md shows is the example plugin's file, byte for byte."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)


def blocks(path: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(path.read_text()) if kind == lang]


README_PY = blocks(ROOT / "README.md", "python")


def test_readme_has_python_blocks():
    assert len(README_PY) >= 2


@pytest.mark.parametrize("index", range(len(README_PY)))
def test_readme_python_block_runs(tmp_path, index):
    code = README_PY[index]
    if "torch" in code:
        pytest.importorskip("torch")
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_") or k == "ERDMA_DISABLE_PLUGINS"}
    r = subprocess.run([sys.executable, "-m", "erdma_core.cli", "run", "-n", "2", "--", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, f"README block {index}:\n{code}\n{r.stdout}\n{r.stderr}"


@pytest.mark.parametrize("doc", ["README.md", "docs/plugins.md"])
def test_toml_blocks_are_valid_configs(tmp_path, monkeypatch, doc):
    from erdma_core import load_config

    tomls = [b for b in blocks(ROOT / doc, "toml") if not b.startswith("# examples/")]
    assert tomls
    if any("unix" in b for b in tomls):
        pytest.importorskip("erdma_example", reason="the example plugin is installed by make test")
        monkeypatch.setenv("ERDMA_PLUGINS", "example")
        monkeypatch.setenv("ERDMA_DISABLE_PLUGINS", "")
    for i, body in enumerate(tomls):
        path = tmp_path / f"block{i}.toml"
        path.write_text(body)
        load_config(path)


def test_plugin_docs_show_the_example_plugin_as_it_is():
    shown = [b for kind, b in FENCE.findall((ROOT / "docs" / "plugins.md").read_text()) if kind in ("python", "toml")
             and b.startswith("# examples/")]
    assert len(shown) >= 5
    for body in shown:
        first, rest = body.split("\n", 1)
        path = ROOT / first.removeprefix("# ")
        assert path.is_file(), first
        assert rest == path.read_text(), f"docs/plugins.md shows {first.removeprefix('# ')} differently"
