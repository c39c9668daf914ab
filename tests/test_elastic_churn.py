"""Elastic groups under churn: peers killed (SIGKILL) and added at random moments while the DiLoCo example
runs, and peers killed in the middle of an outer allreduce. After every outer step every live member must hold
the same state hash; nothing may hang."""

from __future__ import annotations

import collections
import random
import re
import time
from pathlib import Path

import pytest

from erdma_core.testing.elastic import ElasticJob, python

ROOT = Path(__file__).resolve().parents[1]
DILOCO = ROOT / "examples" / "diloco.py"
PEER = ("-m", "erdma_core.testing.elastic_peer")
OUTER = re.compile(r"outer (\d+) epoch (\d+) members (\d+) \[.*\] hash (\w+) loss ([\d.]+)")
STEP = re.compile(r"step (\d+) n (\d+) value (\S+) uniform (\w+) epoch (\d+) hash (\w+) took \S+ retried (\d+)")
ARGS = ("--outer-steps", "40", "--inner-steps", "20", "--step-time", "0.02")
# the churned run's final loss may be up to 50% above the undisturbed run's: in 3 pairs of runs (2026-11-26) the
# undisturbed ones ended at 0.00351-0.00389 and the churned ones (6 kills, 6 joins) at 0.00341-0.00379; in a
# fresh-clone CI run (2026-12-04) at 0.00317 and 0.00398 (+26%). Lost or doubled pseudo-gradients show as
# divergent hashes and missing steps, which the test checks on their own
TOLERANCE = 0.5


def _by_step(job: ElasticJob, pattern: re.Pattern[str]) -> dict[int, set[tuple[str, ...]]]:
    seen: dict[int, set[tuple[str, ...]]] = collections.defaultdict(set)
    for p in job.peers:
        for line in p.lines:
            m = pattern.search(line)
            if m:
                seen[int(m.group(1))].add(m.groups()[1:])
    return seen


def _final(job: ElasticJob) -> list[float]:
    return [float(line.split()[2]) for p in job.peers for line in p.lines if line.startswith("final loss")]


def _diloco(tmp: Path, churn: int, seed: int) -> tuple[ElasticJob, list[int | None], int, int]:
    rng = random.Random(seed)
    kills = joins = 0
    with ElasticJob(python(DILOCO, *ARGS), tmp, min_peers=4) as job:
        for _ in range(4):
            job.start()
        time.sleep(2.0)  # let the job start
        end = time.monotonic() + 60
        while (kills < churn or joins < churn) and time.monotonic() < end:
            time.sleep(rng.uniform(0.2, 1.2))
            live = job.live()  # 3 to 6 peers
            can_kill, can_join = kills < churn and len(live) > 3, joins < churn and len(live) < 6
            if can_kill and (not can_join or rng.random() < 0.5):
                rng.choice(live).kill()
                kills += 1
            elif can_join:
                job.start()
                joins += 1
        codes = job.wait_all(120)
    return job, codes, kills, joins


def test_diloco_through_churn(tmp_path):
    (tmp_path / "calm").mkdir()
    (tmp_path / "churn").mkdir()
    calm, calm_codes, _, _ = _diloco(tmp_path / "calm", 0, 0)
    assert calm_codes == [0, 0, 0, 0], [p.lines[-5:] for p in calm.peers]
    job, codes, kills, joins = _diloco(tmp_path / "churn", 6, 1)
    assert kills >= 5 and joins >= 5
    odd = [(i, c, p.lines[-8:]) for i, (p, c) in enumerate(zip(job.peers, codes, strict=True)) if c not in (0, -9)]
    assert None not in codes, ("a peer hung", odd)  # killed ones read -9, the rest finished
    assert not odd, odd
    steps = _by_step(job, OUTER)
    assert sorted(steps) == list(range(1, 41))
    for step, seen in steps.items():
        assert len({s[2] for s in seen}) == 1, f"outer step {step}: members disagree: {seen}"
    calm_loss, churn_loss = _final(calm)[0], _final(job)
    assert churn_loss and len(set(churn_loss)) == 1
    assert churn_loss[0] <= calm_loss * (1 + TOLERANCE), (calm_loss, churn_loss[0])
    epochs = {int(s[0]) for seen in steps.values() for s in seen}
    late = [line for p in job.peers for line in p.lines if line.startswith("not admitted")]
    assert max(epochs) >= 5, (epochs, late)  # membership did change (at 4c770b8 it stayed at 4 in CI: a newcomer
    # that asked for its path check before the members' first commit was never answered, and said "not admitted")


@pytest.mark.parametrize("kills", [30])
def test_killed_in_the_middle_of_an_allreduce(tmp_path, kills):
    """3 peers stay; a fourth kills itself in the middle of its second allreduce (4 Mi float32: before one of
    its messages picked at random), a new one takes its place, ``kills`` times. Every step's result must be
    uniform (never half-applied), the same on every member, and the average of one value per member; every
    kill inside an allreduce makes the survivors run it again. The job stops once the last newcomer has
    taken a step with the others."""
    stop = tmp_path / "stop"
    with ElasticJob(python(*PEER), tmp_path, min_peers=4, env={"STEPS": "100000", "STOP_FILE": str(stop)}) as job:
        for _ in range(3):
            job.start()
        victim = job.start({"DIE_IN": "2"})
        done, end = 0, time.monotonic() + 240
        while done < kills and time.monotonic() < end:
            if not victim.alive():
                assert victim.proc.returncode == -9, victim.lines[-5:]
                done += 1
                victim = job.start({"DIE_IN": "2"} if done < kills else {})
            time.sleep(0.05)
        while not any(STEP.search(line) for line in victim.lines):  # the last one is a member now
            assert victim.alive() and time.monotonic() < end + 60, victim.lines[-5:]
            time.sleep(0.05)
        stop.touch()
        codes = job.wait_all(60)
    assert done == kills
    assert codes.count(0) == 4 and codes.count(-9) == kills, [p.lines[-3:] for p in job.peers]
    steps = _by_step(job, STEP)
    retried = 0
    for step, seen in steps.items():
        assert len(seen) == 1, f"step {step}: members disagree: {seen}"
        n, value, uniform, _, _, again = next(iter(seen))
        assert uniform == "True", f"step {step}: a result that is not one value throughout"
        total = float(value.removeprefix("np.float32(").rstrip(")")) * int(n)
        assert abs(total - round(total)) < 1e-3 * int(n), f"step {step}: {value} is not an average of {n} values"
        retried += int(again)
    late = sum(line == "late kill" for p in job.peers for line in p.lines)
    assert late <= 3 and retried == kills - late, (retried, late)


def test_a_newcomer_to_a_job_that_has_finished_is_told_and_exits_cleanly(tmp_path):
    """The members stop (their stop file) and finish the job; a peer that comes after learns it at once,
    instead of waiting out its join timeout."""
    stop = tmp_path / "stop"
    with ElasticJob(python(*PEER), tmp_path, min_peers=2, env={"STEPS": "100000", "STOP_FILE": str(stop),
                                                               "ELEMENTS": "1024"}) as job:
        members = [job.start(), job.start()]
        end = time.monotonic() + 60
        while not all(any(STEP.search(line) for line in m.lines) for m in members):
            assert time.monotonic() < end and all(m.alive() for m in members), [m.lines[-3:] for m in members]
            time.sleep(0.05)
        stop.touch()
        assert [m.wait(60) for m in members] == [0, 0]
        late = job.start()
        start = time.monotonic()
        assert late.wait(60) == 0 and "job finished" in late.lines, late.lines[-5:]
        assert time.monotonic() - start < 30  # told, not timed out (join_timeout is 600 s)
