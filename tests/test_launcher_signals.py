"""SIGTERM, SIGINT and SIGHUP to any form of ``erdma run`` (plain, ``--elastic``, ``--join``) stop the
processes it started, remove the secret file it wrote, and end the launcher as that signal does."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from erdma_core.cli.launcher import Signalled, stops_on_signals
from erdma_core.transport.leftovers import running

ERDMA = [sys.executable, "-m", "erdma_core.cli"]
RANK = """
import os, sys, time
open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w").close()
time.sleep(600)
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_") or k == "ERDMA_DISABLE_PLUGINS"}


def _launch(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.Popen[str], Path]:
    """``erdma run ARGS -- python RANK DIR``; its processes write their pids into DIR."""
    where = tmp_path / name
    where.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    proc = subprocess.Popen([*ERDMA, "run", *args, "--", sys.executable, str(script), str(where)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, where


STARTED: list[int] = []  # every process the launchers started, killed after each test if still there


@pytest.fixture(autouse=True)
def _no_leftovers():  # type: ignore[no-untyped-def]
    yield
    for pid in STARTED:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    STARTED.clear()


def _pids(where: Path, n: int, proc: subprocess.Popen[str]) -> list[int]:
    """The pids of the ``n`` processes the launcher started, once all have written theirs."""
    deadline = time.monotonic() + 60
    while len(found := list(where.glob("*.pid"))) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{len(found)} of {n} processes started within 60 s"
        time.sleep(0.05)
    pids = [int(p.stem) for p in found]
    STARTED.extend(pids)
    return pids


def _stopped(proc: subprocess.Popen[str], pids: list[int], signum: int) -> str:
    """Send ``signum`` to the launcher; check it ends as that signal does and leaves none of ``pids``."""
    os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signum, (proc.returncode, err)
    deadline = time.monotonic() + 10
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if running(p)]}"
        time.sleep(0.05)
    return err


SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_to_erdma_run_stops_its_ranks(tmp_path: Path, signum: int) -> None:
    proc, where = _launch(tmp_path, "ranks", "-n", "3")
    err = _stopped(proc, _pids(where, 3, proc), signum)
    assert f"erdma run: got {signal.Signals(signum).name}; stopped the ranks" in err


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_to_an_elastic_run_and_to_a_joining_one_stops_their_peers_and_removes_the_secret(
        tmp_path: Path, signum: int) -> None:
    elastic, peers = _launch(tmp_path, "elastic", "--elastic", "-n", "2")
    pids = _pids(peers, 2, elastic)
    assert elastic.stderr is not None
    said = elastic.stderr.readline() + elastic.stderr.readline()
    join = re.search(r"--join (\S+) --secret-file (\S+)", said)
    assert join is not None, said
    secret = Path(join.group(2))
    assert secret.exists()
    joined, more = _launch(tmp_path, "joined", "--join", join.group(1), "--secret-file", str(secret), "-n", "1")
    _stopped(joined, _pids(more, 1, joined), signum)
    assert elastic.poll() is None  # the job goes on without the joined peer
    _stopped(elastic, pids, signum)
    assert not secret.exists()


def test_a_signal_is_noted_and_raised_only_where_the_launcher_checks() -> None:
    """The handler raises nothing itself: raised between two bytecodes (inside ``Popen.poll``, after it took
    its wait lock and before the ``try`` that frees it), it left that lock held, and the launcher's next
    ``wait`` on the rank blocked for ever: ``erdma run -n 3`` then outlived SIGINT by the test's 60 s."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with stops_on_signals() as stopping:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # a later one is ignored: the first is the one noted
        for _ in range(1000):  # the handlers have run by now; none raised
            time.sleep(0)
        assert stopping.signum == signal.SIGINT
        with pytest.raises(Signalled, match="SIGINT") as raised:
            stopping.check()
        assert raised.value.signum == signal.SIGINT
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # put back
