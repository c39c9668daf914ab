#!/usr/bin/env bash
# The C this project owns, built with AddressSanitizer and UBSan and fed malformed input (make test runs it as a
# step; tests/sanitize/ says what each driver does; the seed corpus is tests/sanitize/corpus/):
#   erdma-quic's ngtcp2 shim: datagrams a stranger or a listener may send, tickets, the receive fast path;
#   erdma-dpdk's shim: erdma-dpdk frames read from a pcap port;  the network lab's relay: Ethernet frames.
# Each shim is a cffi module loaded into Python, so ASan's runtime comes first (LD_PRELOAD) and Python allocates
# with malloc (its objects get red zones); a sanitizer's report ends the driver, and this script, with status 1.
#   SANITIZE_MUTATIONS: mutations of each corpus input (default 500)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$(pwd)/${VENV:-.venv}/bin/python}
n=${SANITIZE_MUTATIONS:-500}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$PY" tests/sanitize/build.py "$out"
asan=$(cc -print-file-name=libasan.so)
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
cd tests/sanitize
for driver in quic_datagrams:erdma_quic dpdk_frames:erdma_dpdk; do
    if [[ -d $out/${driver#*:} ]]; then
        # (Python frees little at exit by design: leaks are not looked for in it)
        ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 PYTHONMALLOC=malloc LD_PRELOAD=$asan \
            "$PY" "${driver%%:*}.py" "$out" corpus --mutations "$n"
    fi
done
ASAN_OPTIONS=halt_on_error=1 "$PY" relay_frames.py "$out" corpus --mutations "$n"
