#!/usr/bin/env bash
# Regenerates docs/benchmarks.md (tables, plots, emulator ceiling, alpha-beta check) from scratch: about
# 100 minutes on the 2-core development machine. Run it through `make bench` (root: the lab builds network
# namespaces). QUICK=1 runs a small subset (a few minutes) to check the pipeline.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=bench-results/docs
rm -rf "$OUT" && mkdir -p "$OUT"
# a run whose jobs failed (exit 2) still reports; wrong results (exit 1) stop everything
run() {
    echo "python -m benchmarks.run $*" >> "$OUT/commands.txt"
    $PY -m benchmarks.run "$@" || { rc=$?; [[ $rc == 2 ]] || exit $rc; }
}
# On one host (loopback) eRDMA's ranks talk over Unix sockets, so it runs twice there: as it is, and with TCP
# (erdma-tcp), beside Open MPI over TCP (mpi) and over shared memory (mpi-sm). Across the lab's links every
# rank has a host of its own and everything is TCP; on the WAN links erdma-quic and hivemind (its averager
# over its own libp2p daemon) run too.
# Sizes up to 64 KiB take many iterations on one host (an op there lasts tens of microseconds, and a single
# scheduling hiccup in a short loop moves the mean), fewer across the lab's slower links.
LOCAL=(--systems erdma,erdma-tcp,gloo,mpi,mpi-sm --small-iters 1000)
LINKS=(--systems erdma,gloo,mpi --small-iters 200)
if [[ "${QUICK:-0}" == 1 ]]; then
    ALLREDUCE=(--ranks 2 --sizes 4K,1M --repeats 1 --iters 3)
    OTHERS=(--ranks 2 --sizes 4K,1M --repeats 1 --iters 3)
    WAN=(--ranks 2 --sizes 4K,1M --repeats 1 --iters 2 --warmup 1 --small-warmup 1)
    AB=(--ranks 2,4 --iters 2)
    LONGFAT=(--sizes 16M --repeats 1 --iters 1 --seconds 10 --cases "erdma c=1,erdma c=8")
    PROFILE_ITERS=300
    CHAOS_EVENTS=10
else
    ALLREDUCE=(--ranks 2,4,8 --sizes 4K,64K,1M,16M,64M,256M --repeats 2 --iters 5 --small-warmup 200 --max-seconds 30)
    OTHERS=(--ranks 4 --sizes 4K,64K,1M,16M,64M --repeats 2 --iters 5 --small-warmup 200 --max-seconds 30)
    WAN=(--ranks 4 --sizes 4K,64K,1M,16M,64M --repeats 1 --iters 1 --small-iters 5 --warmup 1 --small-warmup 1
         --max-seconds 400)
    AB=(--ranks 2,3,4,5,6,7,8 --iters 3)
    LONGFAT=(--sizes 64M,256M --repeats 2)
fi
$PY -m benchmarks.ceiling --json "$OUT/ceiling.json" | tee "$OUT/ceiling.txt"
run --scenarios loopback --ops allreduce "${LOCAL[@]}" "${ALLREDUCE[@]}" --out "$OUT/allreduce-local"
run --scenarios lan,metro --ops allreduce "${LINKS[@]}" "${ALLREDUCE[@]}" --out "$OUT/allreduce"
run --scenarios loopback --ops allgather,broadcast,reduce_scatter,alltoall "${LOCAL[@]}" "${OTHERS[@]}" \
    --out "$OUT/others-local"
run --scenarios lan --ops allgather,broadcast,reduce_scatter,alltoall "${LINKS[@]}" "${OTHERS[@]}" --out "$OUT/others"
run --scenarios regional,continental,lossy --cc bbr,cubic --ops allreduce --systems erdma,erdma-quic,gloo,mpi,hivemind \
    "${WAN[@]}" --out "$OUT/wan"
$PY -m benchmarks.longfat "${LONGFAT[@]}" --json "$OUT/longfat.json" | tee "$OUT/longfat.txt"
$PY -m benchmarks.alphabeta "${AB[@]}" --json "$OUT/alphabeta.json" | tee "$OUT/alphabeta.txt"
$PY -m benchmarks.elastic --scenarios loopback,continental --peers 4 --elements 1M --kills 10 --json "$OUT/elastic.json" | tee "$OUT/elastic.txt"
$PY -m benchmarks.chaos --events "${CHAOS_EVENTS:-1200}" --json "$OUT/chaos.json" | tee "$OUT/chaos.txt"
$PY -m benchmarks.profile_small --iters "${PROFILE_ITERS:-3000}" | tee "$OUT/profile.txt"
$PY -m benchmarks.profile_small --iters "${PROFILE_ITERS:-3000}" --transport quic | tee "$OUT/profile-quic.txt"
$PY -m benchmarks.docs "$OUT" docs/benchmarks.md
