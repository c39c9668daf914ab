"""What the lab tests share: the JSON line each rank of a lab job prints last, collected."""

from __future__ import annotations

import json
import subprocess


def results(procs: list[subprocess.Popen[str]], timeout: float) -> list[dict]:
    """Each rank's last stdout line (JSON), once all exited 0 within ``timeout`` (those still running are
    killed)."""
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs
