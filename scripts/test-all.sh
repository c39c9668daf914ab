#!/usr/bin/env bash
# `make test`'s suites, each one run even when one before it failed: lint, the core's tests, PyTorch's own
# distributed tests (a pytest process of their own: they set process-wide env), each plugin's in its folder
# (erdma-quic's on its default engine, the compiled one), then the core's collective, failure and progress
# tests again over QUIC on aioquic (the reference engine), over QUIC on the compiled engine (ngtcp2) striped
# across a worker, and over DPDK's memif (erdma-dpdk). Each suite runs on pytest-xdist workers (TEST_WORKERS,
# 3 by default; the core's tests one by one, the others a file at a time, the elastic churn test and
# PyTorch's tests alone): most tests wait on their ranks, sockets and timeouts, so on two cores one test's
# waiting is another's running.
# Ends with each step's outcome, wall and CPU seconds, and the 20 slowest tests of the whole run; exits 1 when
# any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(pwd)/${VENV:-.venv}/bin/python
junit=$(mktemp -d)
trap 'rm -rf "$junit"' EXIT
names=() results=()

cpu() {  # CPU=the CPU seconds (user + system) of every child process this shell has waited for so far
    # (`times` in this very shell: in a pipeline or $(...) it runs in a subshell, which has waited for nobody)
    times > "$junit/times"
    CPU=$(awk 'NR == 2 {for (i = 1; i <= 2; i++) {split($i, t, "m"); s += t[1] * 60 + t[2]} printf "%d", s}' \
        "$junit/times")
}

step() {  # step NAME DIR COMMAND...: run COMMAND in DIR; pytest commands write their timings to $junit
    local name=$1 dir=$2 start cpu0 rc
    shift 2
    echo "=== $name"
    start=$(date +%s)
    cpu
    cpu0=$CPU
    (cd "$dir" && "$@")
    rc=$?
    cpu
    names+=("$name")
    results+=("$(printf '%-6s %5ds wall %6ds CPU' "$([[ $rc == 0 ]] && echo ok || echo FAILED)" \
        $(($(date +%s) - start)) $((CPU - cpu0)))")
}

pytest_in() {  # pytest_in NAME DIR ARGS...: that folder's pytest, quiet, its files spread over the workers
    # (a later --dist in ARGS wins: the core's tests go one by one; each worker makes its own shared worlds,
    # which costs little over TCP and much over QUIC, so the re-runs go by file)
    local name=$1 dir=$2
    shift 2
    step "$name" "$dir" "$PY" -m pytest -q -p no:randomly -n "${TEST_WORKERS:-3}" --dist loadfile \
        --junitxml="$junit/${#names[@]}.xml" -o junit_suite_name="$name" "$@"
}

step "lint (ruff)" . "$(dirname "$PY")/ruff" check .
pytest_in "core" . --dist worksteal --ignore=tests/torch_suite --ignore=tests/test_elastic_churn.py
# the churn test alone: beside other tests on the workers its peers failed 2 runs in 5 (cause not found yet)
TEST_WORKERS=0 pytest_in "core: elastic churn, alone" . tests/test_elastic_churn.py
# PyTorch's tests in one process: each worker would import torch and start its worlds again (on 3 workers
# 115 s wall and 225 CPU-s, in one process 102 s and 184)
TEST_WORKERS=0 pytest_in "PyTorch's distributed tests" tests/torch_suite -p no:cacheprovider test_pytorch_distributed.py
for p in plugins/*/ examples/erdma-example/; do
    [[ -f $p/pyproject.toml ]] && pytest_in "$(basename "$p")" "$p"
done
core_again=(tests/test_collectives.py tests/test_failures.py tests/test_progress.py)  # by file: shared worlds
ERDMA_TRANSPORT=quic ERDMA_TRANSPORT_QUIC_SECRET=ci-secret ERDMA_TRANSPORT_QUIC_ENGINE=aioquic \
    pytest_in "core over QUIC (aioquic)" . "${core_again[@]}"
ERDMA_TRANSPORT=quic ERDMA_TRANSPORT_QUIC_SECRET=ci-secret ERDMA_TRANSPORT_QUIC_ENGINE=ngtcp2 \
    ERDMA_TRANSPORT_QUIC_WORKERS=1 ERDMA_TRANSPORT_QUIC_PART_BYTES=65536 \
    pytest_in "core over QUIC (ngtcp2, a worker)" . "${core_again[@]}"
ERDMA_TRANSPORT=dpdk pytest_in "core over DPDK (memif)" . "${core_again[@]}"

echo
echo "=== summary"
failed=0
for i in "${!names[@]}"; do
    echo "  ${results[$i]}  ${names[$i]}"
    [[ ${results[$i]} == ok* ]] || failed=1
done
cpu
echo "  $CPU CPU seconds in all (user and system, every step's processes)"
"$PY" scripts/slowest.py 20 "$junit"/*.xml
exit $failed
