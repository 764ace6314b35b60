#!/usr/bin/env bash
# Downloads into .whl/ the wheels the GPU machine lacks (it has no network): run here, then
# carry .whl with scripts/gpu_check.sh. Pure-Python wheels, versions that load on protobuf >= 5.29.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
PY=${PYTHON:-.venv/bin/python}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
  grpcio-health-checking==1.71.2 grpcio-reflection==1.71.2 uvloop==0.21.0
ls -l .whl
