#!/usr/bin/env bash
# The prepared GPU check, one device call of a few minutes: CUDA tests, parity, then the GPU benchmark.
#   device run: carry [".whl"], command "bash scripts/gpu_check.sh"   (after scripts/fetch_gpu_wheels.sh here)
# Writes logs and JSON under $OUT (the device tool's folder) or /tmp/attnserve-gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/attnserve-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/client:$PWD/server${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, grpc, google.protobuf as p; print('torch', torch.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__)"
} 2>&1 | tee "$OUT/machine.txt"

status=0
timeout 240 python3 -m pytest tests/test_cuda.py tests/test_parity.py tests/test_batcher.py -q -p no:cacheprovider \
  -o addopts="" 2>&1 | tee "$OUT/tests.log" || status=1

bench() {
  local name=$1
  shift
  timeout 200 python3 -m attnserve_server bench --device cuda --duration-s 4 --warmup-s 1 --inprocess-s 2 \
    --json "$OUT/bench-$name.json" "$@" 2>"$OUT/bench-$name.err" | tee "$OUT/bench-$name.txt" || status=1
}
# W1 and WL shapes on the GPU, in bfloat16 (the dtype a GPU deployment would use) and float32 for W1.
bench w1-fp32 --embed-dim 256 --num-heads 8 --seq-len 64 --concurrency 1,32,128
bench wl-bf16 --embed-dim 1024 --num-heads 16 --seq-len 256 --dtype bfloat16 --concurrency 1,32,128
exit $status
