"""``World``: N ranks in N real processes that stay up between calls, for fast multi-rank tests.

    with World(4, config={"transport.name": "tcp"}) as world:
        results = world.run(my_fn, arg)        # my_fn(pg, arg) runs on every rank; one result per rank

``my_fn`` must be importable by name (a module-level function). Processes are forked, so the test module
needs no extra import path. A rank that raises or dies makes ``run`` raise ``RankFailure`` listing every
rank's outcome; every wait is bounded by ``timeout``, the set-up (``init``) by at least ``INIT_TIMEOUT``.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

# The least time a world's set-up may take to answer, whatever a test's ``timeout`` for its calls: a short
# ``timeout`` is about the calls under test, and set-up on a busy host or in an emulated guest takes longer.
INIT_TIMEOUT = 120.0
# A call's bound where the test gives none: 120 s, or ``PYTEST_ERDMA_TIMEOUT`` seconds (an emulated guest on a
# busy host runs a case list of many collectives for minutes: erdma-verbs' tests/guest/collectives.sh)
CALL_TIMEOUT = float(os.environ.get("PYTEST_ERDMA_TIMEOUT", "120"))


class RankFailure(AssertionError):
    """One or more ranks raised or died. ``errors[rank]`` is the exception (or a str for a dead rank)."""

    def __init__(self, op: str, errors: dict[int, BaseException | str], tracebacks: dict[int, str]) -> None:
        self.errors = errors
        lines = [f"{op}: rank {r}: {e!r}\n{tracebacks.get(r, '')}" for r, e in sorted(errors.items())]
        super().__init__("\n".join(lines))


def _worker(rank: int, size: int, url: str, config: Mapping[str, Any] | None, conn: Any) -> None:
    import erdma_core

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # World._collect asks a silent rank where it is

    try:
        pg = erdma_core.init(dict(config or {}), rank=rank, world_size=size, init_method=url)
    except BaseException as exc:
        conn.send(("err", exc, traceback.format_exc()))
        return
    conn.send(("ok", None, ""))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args = msg
        try:
            conn.send(("ok", fn(pg, *args), ""))
        except BaseException as exc:
            try:
                conn.send(("err", exc, traceback.format_exc()))
            except Exception:
                conn.send(("err", RuntimeError(repr(exc)), traceback.format_exc()))
    try:
        pg.destroy()
    finally:
        conn.close()


class World:
    def __init__(self, size: int, config: Mapping[str, Any] | None = None, *, init_method: str | None = None,
                 timeout: float | None = None) -> None:
        self.size = size
        self.timeout = timeout = timeout if timeout is not None else CALL_TIMEOUT
        self.broken = False  # a rank died or did not answer: its pipe may yet bring a stale answer
        self._tmp = tempfile.mkdtemp(prefix="erdma-world-")
        url = init_method or f"file://{self._tmp}/store"
        ctx = mp.get_context("fork")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, size, url, config, child), daemon=True,
                               name=f"erdma-rank-{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        try:
            self._collect("init", max(timeout, INIT_TIMEOUT))
        except BaseException:
            self.close()
            raise

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Run ``fn(pg, *args)`` on every rank; return the per-rank results or raise RankFailure."""
        for conn in self.conns:
            conn.send((fn, args))
        return self._collect(getattr(fn, "__name__", "fn"), timeout or self.timeout)

    def outcomes(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Like ``run`` but return each rank's result or exception (a str for a rank that died)."""
        try:
            return self.run(fn, *args, timeout=timeout)
        except RankFailure as failure:
            return [failure.errors.get(r, self._last[r]) for r in range(self.size)]

    def _collect(self, op: str, timeout: float) -> list[Any]:
        results: list[Any] = [None] * self.size
        errors: dict[int, BaseException | str] = {}
        tbs: dict[int, str] = {}
        for rank, conn in enumerate(self.conns):
            try:
                if not conn.poll(timeout):
                    self.broken = True
                    errors[rank] = f"no answer within {timeout}s (its threads' stacks: stderr)"
                    if self.procs[rank].is_alive():
                        os.kill(self.procs[rank].pid, signal.SIGUSR1)
                        time.sleep(0.5)
                    continue
                status, value, tb = conn.recv()
            except (EOFError, OSError):
                self.broken = True
                self.procs[rank].join(5)
                errors[rank] = f"rank {rank} died (exit code {self.procs[rank].exitcode})"
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors[rank], tbs[rank] = value, tb
        self._last = results
        if errors:
            raise RankFailure(op, errors, tbs)
        return results

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(0.5 if self.broken else 10)  # (a broken world's ranks may wait on a hung one)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
