"""What the eRDMA sides of the guest benchmarks share (``alltoall_stages.py``, ``pingpong_stages.py``): config
overrides from the command line, and ranks forked from this process around one file store, each putting
what it measured on a queue."""

from __future__ import annotations

import multiprocessing as mp
import tempfile
from collections.abc import Callable, Sequence
from typing import Any


def overrides(args: Sequence[str]) -> dict[str, int | str]:
    """``KEY=VALUE`` arguments as config overrides for every rank (a value of digits is an int)."""
    return {k: int(v) if v.isdigit() else v for k, v in (a.split("=", 1) for a in args)}


def run_ranks(world: int, target: Callable[..., None], *args: Any, timeout: float = 3600.0) -> tuple[list[Any], bool]:
    """Fork ``world`` processes, rank r running ``target(r, url, *args, out)``, each putting one result on
    ``out``: the results in the order they came, and whether every rank exited 0."""
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=target, args=(r, f"file://{tmp}/store", *args, out)) for r in range(world)]
        for p in procs:
            p.start()
        results = [out.get(timeout=timeout) for _ in procs]
        for p in procs:
            p.join(60)
    return results, all(p.exitcode == 0 for p in procs)
