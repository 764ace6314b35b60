#!/usr/bin/env bash
# Triton's perf_analyzer, set up in its own virtual environment, driving `attnserve bench`.
#
#   scripts/perf_analyzer.sh --setup            install it (once) and print the binary's path
#   scripts/perf_analyzer.sh --run [flags]      perf_analyzer itself, its CUDA runtime library found
#   scripts/perf_analyzer.sh [bench flags]      attnserve bench --perf-analyzer <it> [bench flags]
#
# perf_analyzer ships in the tritonclient wheel. 2.50.0 is the newest whose binary runs on
# Debian 12's glibc; it links libb64 (Debian: libb64-0d) and the CUDA runtime library
# (PyPI: nvidia-cuda-runtime-cu12) even on a machine without a GPU. Its pins (numpy,
# protobuf) differ from the project's, hence the separate environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PA_VENV=${PA_VENV:-.cache/perf-venv}
PA=$PA_VENV/bin/perf_analyzer

if [ ! -x "$PA" ]; then
  if ! ldconfig -p | grep libb64.so.0d >/dev/null; then  # no -q: under pipefail, ldconfig would get SIGPIPE
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get install -y -q libb64-0d >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null && apt-get install -y -q libb64-0d >/dev/null; }
    else
      echo "perf_analyzer needs libb64.so.0d (Debian package libb64-0d)" >&2
      exit 1
    fi
  fi
  python3 -m venv "$PA_VENV"
  "$PA_VENV/bin/pip" install -q "tritonclient[all]==2.50.0" nvidia-cuda-runtime-cu12
fi
if [ "${1:-}" = "--setup" ]; then
  echo "$PA"
  exit 0
fi
if [ "${1:-}" = "--run" ]; then
  shift
  CUDART=$(ls -d "$PA_VENV"/lib/python3*/site-packages/nvidia/cuda_runtime/lib)
  LD_LIBRARY_PATH=$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec "$PA" "$@"
fi
exec "${ATTNSERVE_VENV:-.venv}/bin/attnserve" bench --perf-analyzer "$PA" "$@"
