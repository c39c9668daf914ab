"""Whether a process still runs, for what a rank leaves behind on the host (sockets, shared-memory files)
and is swept by the next rank once its owner is gone."""

from __future__ import annotations

import os


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: not when there is none, nor when it is a zombie nobody reaped yet (it
    has ended); a process of another user counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # gone since, or no /proc: it ran a moment ago
        return True
