#!/usr/bin/env bash
# Where the time goes on the GPU machine: scripts/profile.sh (Triton's perf_analyzer, each process's and
# thread's CPU per request, py-spy) on CUDA bfloat16 at W1 and WL, then WL's in-process limit through
# `attnserve bench` with 1, 2, 4 and 8 edges. One device call of about 6 minutes; gpu_check.sh's
# Python `bench` client shares the 16 cores with the server, perf_analyzer is C++ and light.
#   here:   scripts/fetch_gpu_wheels.sh          (wheels, py-spy and perf_analyzer into .whl/)
#   device: run carry [".whl"], timeout_s 450, command "bash scripts/gpu_profile.sh"
# Packs its logs into $OUT/gpu-profile.tgz, and every level's summary into $OUT/levels.md ($OUT: the
# device tool's folder, else /tmp/attnserve-gpu).
# Rehearse on a CPU: GPU_ARGS="--device cpu" SCALE=0.5 scripts/gpu_profile.sh (with .venv's python3 on PATH).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/device_lib.sh
. scripts/device_lib.sh
device_results gpu-profile
GPU_ARGS=${GPU_ARGS:---device cuda --dtype bfloat16}
DTYPE=$(sed -n 's/.*--dtype \([a-z0-9]*\).*/\1/p' <<<"$GPU_ARGS")
export DTYPE=${DTYPE:-float32} # the model's, for the bytes profile.sh sends
SCALE=${SCALE:-1} # seconds of load per level, as a multiple of the defaults below

device_python gpu_profile
command -v py-spy >/dev/null || { echo "gpu_profile: no py-spy: run scripts/fetch_gpu_wheels.sh and carry .whl" >&2; exit 3; }

# profile.sh's layout: a "virtual environment" with python and attnserve (here the machine's python3
# with the tree on PYTHONPATH), and perf_analyzer with its libraries where scripts/perf_analyzer.sh keeps them.
VENV=$(mktemp -d)
mkdir -p "$VENV/bin"
# a wrapper, not a link: a link to a virtual environment's python outside it loses that environment
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >"$VENV/bin/python"
chmod +x "$VENV/bin/python"
printf '#!/bin/sh\nexec python3 -m attnserve_server "$@"\n' >"$VENV/bin/attnserve"
chmod +x "$VENV/bin/attnserve"
"$VENV/bin/python" -c "import numpy" || exit 3
export ATTNSERVE_VENV=$VENV
if [ ! -x .cache/perf-venv/bin/perf_analyzer ]; then
  [ -x .whl/pa/perf_analyzer ] || { echo "gpu_profile: no perf_analyzer in .whl/pa: run scripts/fetch_gpu_wheels.sh" >&2; exit 3; }
  LIB=.cache/perf-venv/lib/python3/site-packages/nvidia/cuda_runtime/lib
  mkdir -p .cache/perf-venv/bin "$LIB"
  cp .whl/pa/perf_analyzer .cache/perf-venv/bin/
  cp .whl/pa/*.so* "$LIB/"
fi

{
  nproc
  grep -m1 "model name" /proc/cpuinfo
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c 'import grpc, torch; print("torch", torch.__version__, "grpc", grpc.__version__)'
} 2>&1 | tee "$WORK/machine.txt"

status=0
STEPS=${STEPS:-profile,bench} # which of the three steps below to run (tests: gpu_check.sh runs them too); LEVELS: a regex of step 2's names
# 1. The CUDA tests, again after the first device run's one failure (<= 60 s).
[[ $STEPS == *tests* ]] && timeout 60 python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -o addopts="" 2>&1 |
  tee "$WORK/tests-cuda.log" | tail -n 3 || status=1

# 2. profile.sh at each level (each ~25 s, <= 45 s): NAME, then VAR=value pairs for profile.sh.
level() {
  [[ $STEPS == *profile* ]] || return 0
  local name=$1
  [[ $name =~ ^(${LEVELS:-.*})$ ]] || return 0
  shift
  local seconds
  seconds=$(python3 -c "print(max(9, round(${SECONDS_PA:-9} * $SCALE)))")
  echo "== $name: $*"
  # profile.sh records from perf_analyzer's 4th second, and perf_analyzer must outlast the recording
  env SECONDS_PA="$seconds" SECONDS_SPY=$((seconds - 5)) SPY=0 "$@" timeout 45 bash scripts/profile.sh "$WORK/$name" \
    >"$WORK/$name.log" 2>&1 || {
    status=1
    tail -n 20 "$WORK/$name.log"
  }
  # every level's summary also goes to one file that comes back should the call end before the archive is packed
  [ -f "$WORK/$name/summary.md" ] && { echo "## $name: $*"; cat "$WORK/$name/summary.md"; } >>"$RESULTS/levels.md" &&
    head -n 3 "$WORK/$name/summary.md"
}
W1=(E=256 H=8 L=64)
WL=(E=1024 H=16 L=256)
# The default (auto: 4 edges on 16 CPUs) against one edge, without the idle spinners, with 8 edges and
# with CUDA graphs; py-spy at the default records the engine and every edge (--subprocesses), with the
# idle spinners off (py-spy crashed or hung with their processes alive: profile.sh's usage; under load
# they do not spin anyway).
level w1-c1 "${W1[@]}" CONC=1 SERVE_ARGS="$GPU_ARGS"
level w1-c1-nospin "${W1[@]}" CONC=1 SERVE_ARGS="$GPU_ARGS --idle-spin-ms 0"
level w1-c1-edges1 "${W1[@]}" CONC=1 SERVE_ARGS="$GPU_ARGS --edge-processes 1"
level w1-c1-edges1-nospin "${W1[@]}" CONC=1 SERVE_ARGS="$GPU_ARGS --edge-processes 1 --idle-spin-ms 0"
level w1-c32 "${W1[@]}" CONC=32 SERVE_ARGS="$GPU_ARGS"
level w1-c32-edges1 "${W1[@]}" CONC=32 SERVE_ARGS="$GPU_ARGS --edge-processes 1"
level w1-c32-edges1-spy "${W1[@]}" CONC=32 SERVE_ARGS="$GPU_ARGS --edge-processes 1" SPY=1 SECONDS_PA=12
level w1-c32-edges8 "${W1[@]}" CONC=32 SERVE_ARGS="$GPU_ARGS --edge-processes 8"
level w1-c32-graphs "${W1[@]}" CONC=32 SERVE_ARGS="$GPU_ARGS --cuda-graphs true"
level w1-c128 "${W1[@]}" CONC=128 SERVE_ARGS="$GPU_ARGS"
level wl-c32 "${WL[@]}" CONC=32 MODE=async SERVE_ARGS="$GPU_ARGS"
level wl-c32-spy "${WL[@]}" CONC=32 MODE=async SERVE_ARGS="$GPU_ARGS --idle-spin-ms 0" SPY=1 SPY_FLAGS=--subprocesses SECONDS_PA=12
level w1-c32-spy "${W1[@]}" CONC=32 SERVE_ARGS="$GPU_ARGS --idle-spin-ms 0" SPY=1 SPY_FLAGS=--subprocesses SECONDS_PA=12
level wl-c32-edges1-spy "${WL[@]}" CONC=32 MODE=async SERVE_ARGS="$GPU_ARGS --edge-processes 1" SPY=1 SECONDS_PA=12

# 3. WL through `attnserve bench` with 1, 2, 4 and 8 edges and its in-process limit (<= 100 s): the
#    figures gpu_check.sh's WL step ran out of time for.
[[ $STEPS == *bench* ]] || exit $status
echo "== bench wl"
# shellcheck disable=SC2086 # GPU_ARGS: words on purpose
timeout 100 python3 -m attnserve_server bench $GPU_ARGS --duration-s "$(python3 -c "print(2 * $SCALE)")" \
  --warmup-s 0.5 --inprocess-s 1 --json "$WORK/bench-wl.json" --embed-dim 1024 --num-heads 16 --seq-len 256 \
  --concurrency 32 --edge-processes 1,2,4,8 2>"$WORK/bench-wl.err" | tee "$WORK/bench-wl.txt" || status=1
exit $status
