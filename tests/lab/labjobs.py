"""What the lab tests share: the JSON line each rank of a lab job prints last, collected."""

from __future__ import annotations

import json
import subprocess


def results(procs: list[subprocess.Popen[str]], timeout: float) -> list[dict]:
    """Each rank's last stdout line (JSON), once all exited 0 within ``timeout`` (those still running are
    killed); else an AssertionError with every failed rank's error."""
    done: list[tuple[int, str, str]] = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [f"rank {i} exited with {rc}: {err[-2500:]}" for i, (rc, _, err) in enumerate(done) if rc != 0]
    assert not failed, "\n".join(failed)  # every rank's error: the first to fail is not always rank 0
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in done]
