#!/usr/bin/env bash
# Downloads into .whl/ what the GPU machine lacks (it has no network): run here, then carry .whl with
# scripts/gpu_check.sh or scripts/gpu_profile.sh. The wheels: pure-Python versions that load on
# protobuf >= 5.29, uvloop, py-spy; and .whl/pa/: Triton's perf_analyzer binary with the two libraries
# it links that the machine may lack (libb64, the CUDA 12 runtime), from scripts/perf_analyzer.sh's setup.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
PY=${PYTHON:-.venv/bin/python}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 --platform any -d .whl \
  grpcio-health-checking==1.71.2 grpcio-reflection==1.71.2 uvloop==0.21.0 py-spy==0.4.1
PA=$(scripts/perf_analyzer.sh --setup)
mkdir -p .whl/pa
cp "$PA" .whl/pa/
cp "$(ls -d .cache/perf-venv/lib/python3*/site-packages/nvidia/cuda_runtime/lib)/libcudart.so.12" .whl/pa/
cp "$(ldconfig -p | awk '/libb64.so.0d .*x86-64/ {print $NF; exit}')" .whl/pa/
ls -l .whl .whl/pa
du -sh .whl
