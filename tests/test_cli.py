"""The ``erdma`` command line: run, bench, doctor."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import textwrap

import pytest

ERDMA = [sys.executable, "-m", "erdma_core.cli"]


def erdma(*args, timeout=120, env_extra=None, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ERDMA_") or k == "ERDMA_DISABLE_PLUGINS"}
    kw.setdefault("capture_output", "stdout" not in kw)
    return subprocess.run([*ERDMA, *args], text=True, timeout=timeout, env=env | (env_extra or {}), **kw)


def script(tmp_path, text):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_run_starts_ranks_with_env(tmp_path):
    job = script(tmp_path, '''
        import erdma_core, numpy as np
        pg = erdma_core.init()
        a = np.array([pg.rank()], np.int64)
        pg.allreduce(a)
        print("sum", int(a[0]), "of", pg.size())
        pg.destroy()
    ''')
    r = erdma("run", "-n", "3", "--", sys.executable, job)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [f"[rank {i}] sum 3 of 3" for i in range(3)]


def test_run_one_rank_failing_ends_all_and_exits_nonzero(tmp_path):
    job = script(tmp_path, '''
        import os, time
        if os.environ["RANK"] == "1":
            raise SystemExit("boom on rank 1")
        time.sleep(300)
    ''')
    r = erdma("run", "-n", "3", "--", sys.executable, job, timeout=60)
    assert r.returncode == 1
    assert "[rank 1] boom on rank 1" in r.stderr
    assert "erdma run: rank 1 exited with code 1; stopped the other ranks" in r.stderr


def test_run_rejects_bad_config_before_starting(tmp_path):
    bad = tmp_path / "erdma.toml"
    bad.write_text('[transport]\nname = "quik"\n')
    r = erdma("run", "-n", "2", "--config", str(bad), "--", sys.executable, "-c", "pass")
    assert r.returncode == 2
    assert "invalid value 'quik'" in r.stderr and ("plugin 'quic' (erdma-quic" in r.stderr
                                                   or "no installed plugin provides transport 'quik'" in r.stderr)


def test_an_algorithm_a_plugin_brings_names_the_plugin_when_it_is_missing(tmp_path):
    conf = tmp_path / "erdma.toml"
    conf.write_text('[collectives]\nallreduce = "naca"\n')
    r = erdma("run", "-n", "2", "--config", str(conf), "--", sys.executable, "-c", "pass",
              env_extra={"ERDMA_DISABLE_PLUGINS": "naca"})
    assert r.returncode == 2
    assert "config key 'collectives.allreduce': invalid value 'naca'" in r.stderr, r.stderr
    assert "erdma-naca" in r.stderr and "left out by ERDMA_PLUGINS/ERDMA_DISABLE_PLUGINS" in r.stderr, r.stderr


@pytest.mark.parametrize(("command", "value", "says"), [("run", "0", "at least 1, got 0"),
                                                        ("run", "-2", "at least 1, got -2"),
                                                        ("bench", "two", "a whole number, got 'two'")])
def test_a_bad_rank_count_is_a_usage_error_not_a_traceback(command, value, says):
    r = erdma(command, "-n", value, *(["--", sys.executable, "-c", "pass"] if command == "run" else []))
    assert r.returncode == 2
    assert f"erdma {command}: error: argument -n/--nprocs: ranks to start: {says}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_run_refuses_more_ranks_than_its_bound_unless_told(tmp_path):
    """-n above --max-ranks (256) starts nothing and says which flag lifts the bound; with the flag, it runs."""
    marker = tmp_path / "started"
    r = erdma("run", "-n", "100000", "--", "/usr/bin/touch", str(marker))
    assert r.returncode == 2 and not marker.exists()
    assert r.stderr.strip() == ("erdma run: -n 100000 is above --max-ranks 256, the most processes erdma run starts on "
                                "this host unless told (--max-ranks 100000 lifts it)"), r.stderr
    r = erdma("run", "-n", "3", "--max-ranks", "2", "--", "/usr/bin/touch", str(marker))
    assert r.returncode == 2 and "--max-ranks 3 lifts it" in r.stderr and not marker.exists()
    r = erdma("run", "-n", "3", "--max-ranks", "3", "--", "/usr/bin/touch", str(marker))
    assert r.returncode == 0 and marker.exists(), r.stderr


@pytest.mark.parametrize(("program", "why"), [("/nonexistent/binary", "No such file or directory"),
                                              ("no-such-program-erdma", "not found on PATH"),
                                              ("/tmp", "not an executable file")])
def test_run_says_in_one_line_which_command_cannot_start(program, why):
    r = erdma("run", "-n", "2", "--", program)
    assert r.returncode == 127
    assert r.stderr.strip() == f"erdma run: cannot start {program!r}: {why}", r.stderr


def test_bench_prints_validated_table():
    r = erdma("bench", "-n", "2", "--sizes", "4K,64K", "--iters", "2", "--warmup", "1")
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.strip() and not line.startswith("#")]
    assert [row[0] for row in rows] == ["4096", "65536"]
    assert all(row[3] == "allreduce" and row[4] == "sum" and row[-2:] == ["0", "0"] for row in rows)  # exact
    head = next(line for line in r.stdout.splitlines() if "size(B)" in line).split()
    assert head == ["#", "size(B)", "count", "type", "op", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong",
                    "maxerr"]
    assert "[bench]" not in r.stderr and "[bench]" not in r.stdout  # no progress text where no terminal shows it
    assert "# backend: erdma  ranks: 2  transport: tcp  algorithm: auto  compression: none" in r.stdout, r.stdout


@pytest.mark.parametrize("piped", [False, True])
def test_bench_shows_progress_only_when_its_output_is_on_a_terminal(piped):
    """stdout and stderr on a terminal (a pty): progress is shown. stdout a pipe (``erdma bench | cat``), stderr
    still the terminal: no progress, so nothing lands between the table's lines; stdout holds the table alone."""
    master, slave = pty.openpty()
    try:
        r = erdma("bench", "-n", "2", "--sizes", "4K,64K", "--iters", "400", "--warmup", "1", "--small-iters", "400",
                  stdout=subprocess.PIPE if piped else slave, stderr=slave)
    finally:
        os.close(slave)
    shown = b""
    while select.select([master], [], [], 30)[0]:  # (a rank that kept the terminal open cannot hang the test)
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the terminal's other end is closed and everything was read
            break
        if not data:
            break
        shown += data
    os.close(master)
    assert r.returncode == 0
    assert (b"\r[bench] erdma allreduce 4K " in shown) == (not piped), shown
    table = r.stdout if piped else shown.decode().replace("\r\n", "\n")
    assert "busbw(GB/s)" in table, table
    if piped:
        lines = r.stdout.splitlines()
        assert all(line.startswith("#") or line.split()[0].isdigit() for line in lines), r.stdout


def test_bench_names_the_compressor_it_ran_with():
    pytest.importorskip("erdma_gpucomp", reason="the compressor comes from erdma-gpucomp")
    args = ("bench", "-n", "2", "--sizes", "256K", "--iters", "1", "--warmup", "0", "--small-warmup", "0",
            "--algorithm", "ring")
    fp16 = {"ERDMA_COMPRESSION_NAME": "fp16", "ERDMA_DISABLE_PLUGINS": ""}
    r = erdma(*args, "--rtol", "0.01", env_extra=fp16)
    assert r.returncode == 0, r.stderr
    assert "transport: tcp  algorithm: ring  compression: fp16 (from 1024 bytes, ops auto)" in r.stdout, r.stdout
    # random data, which fp16 does not carry exactly: the error is reported, and counts as wrong without --rtol
    row = next(line.split() for line in r.stdout.splitlines() if line.strip().startswith("262144"))
    assert row[-2] == "0" and 1e-5 < float(row[-1]) < 1e-2, row
    r = erdma(*args, env_extra=fp16)
    assert r.returncode == 1, r.stderr
    row = next(line.split() for line in r.stdout.splitlines() if line.strip().startswith("262144"))
    assert int(row[-2]) > 0 and float(row[-1]) > 1e-5, row


def test_bench_other_ops():
    for op in ("allgather", "reduce_scatter", "alltoall", "broadcast"):
        r = erdma("bench", "-n", "2", "--op", op, "--sizes", "8K", "--iters", "1", "--warmup", "0")
        assert r.returncode == 0, (op, r.stderr)
        assert f" {op} " in r.stdout


def test_bench_warms_small_sizes_up_as_told():
    """``--small-warmup`` runs that many untimed iterations before each size up to 64 KiB, ``--warmup``
    before larger ones; only the timed ones count."""
    import numpy as np

    from erdma_core.cli.bench import bench

    class Counting:  # one rank, whose allreduce leaves its data as they are
        name, rank, size = "counting", 0, 1

        def __init__(self) -> None:
            self.calls: list[int] = []

        def wrap(self, arr):
            return arr

        def op(self, op, out, inp):
            self.calls.append(out.nbytes)

        def max_over_ranks(self, value):
            return value

        sum_over_ranks = max_over_ranks

    b = Counting()
    rows = bench(b, "allreduce", [4096, 1 << 20], np.dtype(np.float32), iters=2, warmup=1, small_iters=3,
                 small_warmup=5)
    assert [b.calls.count(4096), b.calls.count(1 << 20)] == [5 + 3, 1 + 2]
    assert [r["wrong"] for r in rows] == [0, 0]
    b = Counting()
    bench(b, "allreduce", [4096], np.dtype(np.float32), iters=2, warmup=1)
    assert len(b.calls) == 1 + 2  # without it, small sizes warm up as --warmup says


def test_bench_command_warms_small_sizes_up_200_times_unless_told():
    """``erdma bench`` (and ``make demo``) time small sizes after OSU's 200 untimed iterations by default: a
    user who only says ``--warmup`` still gets them; ``--small-warmup`` changes it, and the ranks are told."""
    import argparse

    from erdma_core.cli.bench import add_arguments, forwarded

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert ap.parse_args(["--warmup", "1"]).small_warmup == 200
    args = ap.parse_args(["--small-warmup", "7"])
    line = forwarded(args)
    assert line[line.index("--small-warmup") + 1] == "7"


def test_doctor_reports_host():
    r = erdma("doctor")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "interfaces:" in r.stdout and "lo" in r.stdout and "127.0.0.1" in r.stdout
    assert "transport: tcp" in r.stdout and "RDMA devices:" in r.stdout and "GPU:" in r.stdout


def test_doctor_reports_what_init_would_refuse_as_a_problem_and_goes_on():
    r = erdma("doctor", env_extra={"ERDMA_COMPRESSION_OPS": "allreduce,bogus"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "problem: config key 'compression.ops': invalid value 'allreduce,bogus'" in r.stdout, r.stdout
    assert "transport: tcp" in r.stdout and "Traceback" not in r.stderr


def test_root_that_finishes_first_and_exits_does_not_fail_the_others(tmp_path):
    """The root's data arrives before the others post their receives, then the root leaves (BYE)."""
    job = script(tmp_path, '''
        import time, erdma_core, numpy as np
        pg = erdma_core.init()
        if pg.rank() != 0:
            time.sleep(0.5)
        a = np.array([pg.rank() + 10], np.int64)
        pg.broadcast(a, 0)
        print("got", int(a[0]))
        pg.destroy()
    ''')
    r = erdma("run", "-n", "4", "--", sys.executable, job)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [f"[rank {i}] got 10" for i in range(4)]


def test_run_reports_a_bad_config_once_before_starting_ranks(tmp_path):
    """./erdma.toml and ERDMA_* are checked by `erdma run` itself: one error, no rank started."""
    (tmp_path / "erdma.toml").write_text('[timeouts]\ncollective = "soon"\n')
    r = erdma("run", "-n", "3", "--", sys.executable, "-c", "print('started')", cwd=tmp_path)
    assert r.returncode == 2 and "started" not in r.stdout
    assert r.stderr.count("config key 'timeouts.collective'") == 1
    assert r.stderr.startswith("erdma: error: config file 'erdma.toml': config key 'timeouts.collective'")
    (tmp_path / "erdma.toml").unlink()
    r = erdma("run", "-n", "3", "--", sys.executable, "-c", "print('started')", cwd=tmp_path,
              env_extra={"ERDMA_TIMEOUT": "abc"})
    assert r.returncode == 2 and "started" not in r.stdout
    assert r.stderr.strip() == "erdma: error: environment variable ERDMA_TIMEOUT: config key 'timeouts.collective': " \
                               "value 'abc' is not a valid float"


def test_bench_help_lists_every_option():
    from erdma_core.cli import bench

    r = erdma("bench", "--help")
    assert r.returncode == 0
    import argparse

    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    for action in ap._actions:
        for flag in action.option_strings:
            assert flag in r.stdout, flag
    assert "-n NPROCS" in r.stdout and "--config" in r.stdout


def test_bench_compare_gloo_without_torch_says_what_to_install(tmp_path):
    """Checked before any rank starts (a torch that cannot be imported stands in for a missing one)."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named torch (test stand-in)')\n")
    r = erdma("bench", "-n", "2", "--compare", "gloo", "--sizes", "4K", env_extra={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 2 and "[bench]" not in r.stderr and "busbw" not in r.stdout
    assert "needs torch" in r.stderr and "pip install 'erdma-core[torch]'" in r.stderr
