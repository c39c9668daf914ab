#!/usr/bin/env bash
# The GPU checks of erdma-gpucomp, in one go, on a machine with a CUDA GPU and no network: the plugin's tests
# (tests/test_gpu.py runs there), the codec benchmark on the GPU, and 2-rank 64 MiB allreduces over loopback TCP
# with int8 or lz4 encoding on the GPU or the CPU, pipelined (compression.pipeline) or not, and uncompressed. Wheels it needs (erdma-core, erdma-gpucomp, lz4,
# zstandard, stevedore, nvidia-nvcomp-cu13 and nvidia-libnvcomp-cu13) lie in $WHEELS (default .whl); logs go to
# $OUT (default /tmp/gpu_check). The machine needs Python 3.12 with cupy, torch, numpy, attrs, pluggy and pytest
# (the lent GPU machines have them). Make the wheels where pip reaches an index, in the repository root:
#   pip wheel --no-deps --no-build-isolation -w .whl . plugins/erdma-gpucomp
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     lz4 zstandard stevedore nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12
set -u
WHEELS=${WHEELS:-.whl}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
{
  nvidia-smi -L
  python3 -c "import sys, cupy, torch; from nvidia import nvcomp; print(sys.version.split()[0], 'cupy', cupy.__version__, 'torch', torch.__version__, 'nvcomp', nvcomp.__version__, nvcomp.__cuda_version__)"
} 2>&1 | tee "$OUT/env.log"
here=$PWD
cd plugins/erdma-gpucomp || exit 1
timeout 200 python3 -m pytest -q -p no:randomly -p no:cacheprovider -rs tests 2>&1 | tee "$OUT/pytest.log" | tail -15
timeout 90 python3 benchmarks/codecs.py --device cuda 2>&1 | tee "$OUT/codecs.log"
timeout 90 python3 benchmarks/codecs.py --device cuda --layers 8 --d-model 512 --message-mib 16 2>&1 | tee "$OUT/codecs_large.log"
cd "$here" || exit 1
for run in "none cpu false" "int8 cuda false" "int8 cuda true" "int8 cpu false" "int8 cpu true" \
           "int8 cuda false" "int8 cuda true" "lz4 cuda false" "lz4 cuda true" "lz4 cpu false"; do
  set -- $run
  echo "== compression $1, device $2, pipeline $3"
  ERDMA_COMPRESSION=$1 ERDMA_COMPRESSION_INT8_DEVICE=$2 ERDMA_COMPRESSION_LZ4_DEVICE=$2 ERDMA_COMPRESSION_PIPELINE=$3 \
    ERDMA_TRANSPORT_TCP_LOCAL_SOCKETS=false timeout 45 erdma bench -n 2 --sizes 64M --iters 5 --rtol 0.01 2>&1 | tail -1
done 2>&1 | tee "$OUT/bench.log"
