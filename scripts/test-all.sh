#!/usr/bin/env bash
# `make test`'s suites, each one run even when one before it failed: lint, the core's tests, PyTorch's own
# distributed tests (a pytest process of their own: they set process-wide env), each plugin's in its folder
# (erdma-quic's on its default engine, the compiled one), then the core's collective tests again over QUIC on
# aioquic (the reference engine), and its collective, failure and progress tests over QUIC on the compiled
# engine (ngtcp2) striped across a worker and over DPDK's memif (erdma-dpdk); erdma-verbs' suite, in a qemu
# guest, boots first and runs beside all of these. Each suite runs on pytest-xdist
# workers (TEST_WORKERS, 3 by default; the core's tests one by one, the others a file at a time, the elastic
# churn test and PyTorch's tests alone): most tests wait on their ranks, sockets and timeouts, so on two
# cores one test's waiting is another's running. Ends with each step's outcome, wall and CPU seconds, and the
# 20 slowest tests of the whole run; exits 1 when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(pwd)/${VENV:-.venv}/bin/python
junit=$(mktemp -d)
trap 'rm -rf "$junit"' EXIT
names=() results=()

cpu_in() {  # cpu_in FILE: the children's CPU seconds (user + system) in what `times` wrote to FILE
    awk 'NR == 2 {for (i = 1; i <= 2; i++) {split($i, t, "m"); s += t[1] * 60 + t[2]} printf "%d", s}' "$1"
}

cpu() {  # CPU=the CPU seconds (user + system) of every child process this shell has waited for so far
    # (`times` in this very shell: in a pipeline or $(...) it runs in a subshell, which has waited for nobody)
    times > "$junit/times"
    CPU=$(cpu_in "$junit/times")
}

record() {  # record NAME RC WALL_SECONDS CPU_SECONDS: a step's line for the summary
    names+=("$1")
    results+=("$(printf '%-6s %5ds wall %6ds CPU' "$([[ $2 == 0 ]] && echo ok || echo FAILED)" "$3" "$4")")
}

guest_running() {  # the guest's background job has not been reaped yet
    [[ -n ${guest_pid:-} ]] && kill -0 "$guest_pid" 2>/dev/null
}

step() {  # step NAME DIR COMMAND...: run COMMAND in DIR; pytest commands write their timings to $junit
    local name=$1 dir=$2 start cpu0 rc guest_before
    shift 2
    echo "=== $name"
    start=$(date +%s)
    guest_running && guest_before=1 || guest_before=0
    cpu
    cpu0=$CPU
    (cd "$dir" && "$@")
    rc=$?
    cpu
    if ((guest_before)) && ! guest_running; then  # reaped during this step: its CPU is the guest's, not this step's
        CPU=$((CPU - $(cpu_in "$junit/guest.times" 2>/dev/null || echo 0)))
    fi
    record "$name" "$rc" $(($(date +%s) - start)) $((CPU - cpu0))
}

pytest_cmd() {  # pytest_cmd XML NAME ARGS...: pytest, quiet, its files spread over the workers, timings to XML
    # (a later --dist in ARGS wins: the core's tests go one by one; each worker makes its own shared worlds,
    # which costs little over TCP and much over QUIC, so the others go by file, and a file's tests on shared
    # worlds by world size: erdma_core.testing.pytest_plugin's groups for --dist loadgroup)
    local xml=$1 name=$2
    shift 2
    "$PY" -m pytest -q -p no:randomly -n "${TEST_WORKERS:-3}" --dist loadgroup --junitxml="$xml" \
        -o junit_suite_name="$name" "$@"
}

pytest_in() {  # pytest_in NAME DIR ARGS...: that folder's pytest as a step
    local name=$1 dir=$2
    shift 2
    step "$name" "$dir" pytest_cmd "$junit/${#names[@]}.xml" "$name" "$@"
}

# erdma-verbs' suite boots a qemu guest, which keeps a core busy for many minutes and waits on nothing here. It
# starts first (its image began building beside `make test`'s installs) and runs beside every other step: the
# two sides took about as long as each other under load (1,579 s the guest, 1,573 s the steps up to the
# plugins'), and the re-runs waited for it, 6 minutes on the critical path (a test world's set-up waits at
# least 120 s, erdma_core.testing.world.INIT_TIMEOUT, long enough for the guest's ranks beside the core's tests)
guest=plugins/erdma-verbs
if [[ -f $guest/pyproject.toml ]]; then
    (start=$(date +%s)
     (cd "$guest" && pytest_cmd "$junit/guest.xml" erdma-verbs)
     rc=$?
     times > "$junit/guest.times"
     echo "$rc $(($(date +%s) - start))" > "$junit/guest.rc") > "$junit/guest.log" 2>&1 &
    guest_pid=$!
fi
step "lint (ruff)" . "$(dirname "$PY")/ruff" check .
# the C this project owns under AddressSanitizer and UBSan, fed a corpus of malformed input and its mutations
step "sanitizers (ASan, UBSan)" . env PY="$PY" scripts/sanitize.sh
pytest_in "core" . --dist worksteal --ignore=tests/torch_suite --ignore=tests/test_elastic_churn.py \
    --ignore=tests/test_elastic_chaos.py
# the churn test apart from the others: beside other tests on the workers its peers failed 2 runs in 5 (cause
# not found yet); beside it on a second worker only the short chaos run of elastic membership on etcd
TEST_WORKERS=2 pytest_in "core: elastic churn and chaos" . tests/test_elastic_churn.py tests/test_elastic_chaos.py
# PyTorch's tests in one process: each worker would import torch and start its worlds again (on 3 workers
# 115 s wall and 225 CPU-s, in one process 102 s and 184)
TEST_WORKERS=0 pytest_in "PyTorch's distributed tests" tests/torch_suite -p no:cacheprovider test_pytorch_distributed.py
# by file: erdma-p2p's NAT labs spread one test per worker took 73 s instead of 141 beside a busy loop, but with
# the guest, a busy loop and a chaos soak also running, 3 labs at once failed 3 tests in one run (a 2 s path
# check and a 5 s STUN answer missed, a job past 66 s)
for p in plugins/*/ examples/erdma-example/; do
    [[ -f $p/pyproject.toml && ${p%/} != "$guest" ]] && pytest_in "$(basename "$p")" "$p"
done
core_again=(tests/test_collectives.py tests/test_failures.py tests/test_progress.py)  # by file: shared worlds
# aioquic, the reference engine, moves the collectives' data; how a peer's failure or a stall shows is the
# mesh's, the same code for both engines (erdma-quic's tests/test_mesh.py runs its outage and 0-RTT
# reconnection on each), re-run below on the default engine. Up to 4 ranks: the 8-rank world (28 QUIC
# connections) runs on the default engine below; on aioquic it was 64 of this step's 132 worker-seconds
ERDMA_TRANSPORT=quic ERDMA_TRANSPORT_QUIC_SECRET=ci-secret ERDMA_TRANSPORT_QUIC_ENGINE=aioquic \
    PYTEST_ERDMA_WORLDS=1,2,3,4 pytest_in "core's collectives over QUIC (aioquic)" . tests/test_collectives.py
ERDMA_TRANSPORT=quic ERDMA_TRANSPORT_QUIC_SECRET=ci-secret ERDMA_TRANSPORT_QUIC_ENGINE=ngtcp2 \
    ERDMA_TRANSPORT_QUIC_WORKERS=1 ERDMA_TRANSPORT_QUIC_PART_BYTES=65536 \
    pytest_in "core over QUIC (ngtcp2, a worker)" . "${core_again[@]}"
# up to 4 ranks: 8 polling ranks on two busy cores went 19 s without hearing each other (peer_timeout 10 s) in
# one run of two under load; 8-rank schedules run on TCP in the core's step
ERDMA_TRANSPORT=dpdk PYTEST_ERDMA_WORLDS=1,2,3,4 pytest_in "core over DPDK (memif)" . "${core_again[@]}"

if [[ -n ${guest_pid:-} ]]; then
    echo "=== erdma-verbs (ran beside the steps above)"
    wait "$guest_pid"
    cat "$junit/guest.log"
    read -r rc seconds < "$junit/guest.rc" || { rc=1; seconds=0; }
    guest_cpu=$(cpu_in "$junit/guest.times" 2>/dev/null)
    record "erdma-verbs (beside)" "$rc" "$seconds" "${guest_cpu:-0}"
fi

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
