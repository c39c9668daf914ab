"""The erdma pytest plugin's groups for ``--dist loadgroup`` (scripts/test-all.sh runs every step but the core's
that way): a file's tests stay on one worker, except that its tests on ``erdma_shared_world`` go by world size
and an explicit ``xdist_group`` mark wins; and pytest-xdist applies them (it stops doing so with pytest 9.2,
pytest-xdist#1386, hence the pin in pyproject.toml)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SUITE = '''
import pytest

@pytest.mark.parametrize("size", [1, 2, 3])
def test_shared(erdma_shared_world, size):
    pass

@pytest.mark.parametrize("i", range(4))
def test_plain(i):
    pass

@pytest.mark.xdist_group("on its own")
def test_marked():
    pass
'''


def test_a_files_tests_go_together_and_shared_worlds_by_size(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(SUITE)
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:randomly", "-p", "no:cacheprovider",
                          "-n", "3", "--dist", "loadgroup", "test_grouped.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d)\] .* PASSED test_grouped\.py::(\w+(?:\[\w+\])?)@(.+?)\s*$", run.stdout, re.M)
    groups = {test: group for _, test, group in ran}
    assert groups == {"test_shared[1]": "test_grouped.py:1", "test_shared[2]": "test_grouped.py:2",
                      "test_shared[3]": "test_grouped.py:3", "test_marked": "on its own",
                      **{f"test_plain[{i}]": "test_grouped.py" for i in range(4)}}, run.stdout
    workers = {group: {w for w, _, g in ran if g == group} for group in set(groups.values())}
    assert all(len(w) == 1 for w in workers.values()), workers  # each group on one worker


HUNG = '''
import time

import pytest

from erdma_core.testing.world import RankFailure


def one_rank_hangs(pg):
    if pg.rank() == 1:
        time.sleep(4)
    return "late"


def ranks(pg):
    return pg.rank()


def test_a_rank_hangs(erdma_shared_world):
    with pytest.raises(RankFailure, match="no answer within 1"):
        erdma_shared_world(2, {"transport.name": "tcp"}, timeout=1).run(one_rank_hangs)


def test_the_next_test_gets_a_healthy_world(erdma_shared_world):
    time.sleep(4)  # rank 1's late answer is in the old world's pipe by now
    assert erdma_shared_world(2, {"transport.name": "tcp"}, timeout=1).run(ranks) == [0, 1]
'''


def test_a_shared_world_whose_rank_hung_is_replaced_for_the_next_test(tmp_path: Path) -> None:
    """Before: the next test on the same shared world read the hung rank's late answer as its own (in CI, one
    rank timing out in the guest failed four later tests with wrong results)."""
    (tmp_path / "test_hung.py").write_text(HUNG)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                          "test_hung.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
