#!/usr/bin/env bash
# `make test`'s suites, each one run even when one before it failed: lint, the core's tests, PyTorch's own
# distributed tests (a pytest process of their own: they set process-wide env), each plugin's in its folder
# (erdma-quic's on its default engine, the compiled one), then the core's collective, failure and progress
# tests again over QUIC on aioquic (the reference engine), over QUIC on the compiled engine (ngtcp2) striped
# across a worker, and over DPDK's memif (erdma-dpdk). Ends with each step's outcome and time and the 20
# slowest tests of the whole run; exits 1 when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(pwd)/${VENV:-.venv}/bin/python
junit=$(mktemp -d)
trap 'rm -rf "$junit"' EXIT
names=() results=()

step() {  # step NAME DIR COMMAND...: run COMMAND in DIR; pytest commands write their timings to $junit
    local name=$1 dir=$2 start rc
    shift 2
    echo "=== $name"
    start=$(date +%s)
    (cd "$dir" && "$@")
    rc=$?
    names+=("$name")
    results+=("$(printf '%-6s %5ds' "$([[ $rc == 0 ]] && echo ok || echo FAILED)" $(($(date +%s) - start)))")
}

pytest_in() {  # pytest_in NAME DIR ARGS...: that folder's pytest, quiet, in file order
    local name=$1 dir=$2
    shift 2
    step "$name" "$dir" "$PY" -m pytest -q -p no:randomly --junitxml="$junit/${#names[@]}.xml" \
        -o junit_suite_name="$name" "$@"
}

step "lint (ruff)" . "$(dirname "$PY")/ruff" check .
pytest_in "core" . --ignore=tests/torch_suite
pytest_in "PyTorch's distributed tests" tests/torch_suite -p no:cacheprovider test_pytorch_distributed.py
for p in plugins/*/ examples/erdma-example/; do
    [[ -f $p/pyproject.toml ]] && pytest_in "$(basename "$p")" "$p"
done
core_again=(tests/test_collectives.py tests/test_failures.py tests/test_progress.py)
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
"$PY" scripts/slowest.py 20 "$junit"/*.xml
exit $failed
