"""``ERDMA_DEBUG``: the library's INFO lines on stderr with no change to the program, one line per rank at set-up
saying what it runs with (transport, allreduce, compression), and a level it does not know refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from erdma_core.engine.codec_set import REDUCTIONS, applies

JOB = textwrap.dedent("""
    import erdma_core, numpy as np
    pg = erdma_core.init()
    a = np.ones(4, np.float32)
    pg.allreduce(a)
    pg.destroy()
""")


def _run(tmp_path, debug: str | None) -> subprocess.CompletedProcess[str]:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_") or k == "ERDMA_DISABLE_PLUGINS"}
    if debug is not None:
        env["ERDMA_DEBUG"] = debug
    return subprocess.run([sys.executable, "-m", "erdma_core.cli", "run", "-n", "2", "--", sys.executable, str(job)],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("debug", ["INFO", "info", None, ""])
def test_erdma_debug_info_says_what_each_rank_set_up(tmp_path, debug):
    r = _run(tmp_path, debug)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        said = f"INFO erdma: rank {rank} of 2: transport tcp, allreduce auto, no compression"
        assert (said in r.stderr) == bool(debug), r.stderr


def test_an_unknown_level_is_refused_naming_the_variable(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import erdma_core"], capture_output=True, text=True, timeout=60,
                       env=os.environ | {"ERDMA_DEBUG": "loud"})
    assert r.returncode == 1
    assert ("ConfigError: environment variable ERDMA_DEBUG='loud' is not a log level; valid: DEBUG, INFO, WARNING, "
            "ERROR") in r.stderr, r.stderr


def test_what_compression_applies_to_in_words():
    sender = SimpleNamespace(name="int8")
    lossy = SimpleNamespace(sender=sender, lossy=True, ops=REDUCTIONS, min_bytes=65536, link_rate=None)
    assert applies(lossy) == ("compression 'int8' (lossy) on allreduce, reduce, reduce_scatter: every message of "
                              "65536 bytes or more, smaller ones raw")
    lossless = SimpleNamespace(sender=SimpleNamespace(name="zstd"), lossy=False, ops=None, min_bytes=0,
                               link_rate=lambda peer: 1e9)
    assert applies(lossless) == ("compression 'zstd' (lossless) on every collective: per message when it saves "
                                 "time on the link of 0 bytes or more, smaller ones raw")
    assert applies(SimpleNamespace(sender=None)) == "no compression"
