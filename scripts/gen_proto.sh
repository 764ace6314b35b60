#!/usr/bin/env bash
# Generates the Python protobuf/gRPC code under client/ from proto/; --check fails on drift.
#
# protoc is pinned (grpcio-tools 1.71.2, protoc 29 -> gencode 5.29) and installed
# into .cache/ apart from the project's environment: the gencode version sets the
# oldest protobuf runtime that can load it, so an old protoc keeps the floor low.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS_VERSION=1.71.2
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
TOOLS_DIR=.cache/grpcio-tools-$TOOLS_VERSION
if [ ! -d "$TOOLS_DIR/grpc_tools" ]; then
  "$PY" -m pip install -q --no-deps --target "$TOOLS_DIR" "grpcio-tools==$TOOLS_VERSION"
fi
out=client
if [ "${1:-}" = "--check" ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
PYTHONPATH="$TOOLS_DIR" "$PY" -m grpc_tools.protoc -I proto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  attnserve/v1/attention.proto
if [ "${1:-}" = "--check" ]; then
  for f in attention_pb2.py attention_pb2.pyi attention_pb2_grpc.py; do
    if ! cmp -s "$out/attnserve/v1/$f" "client/attnserve/v1/$f"; then
      echo "generated code is stale: client/attnserve/v1/$f differs from proto/; run scripts/gen_proto.sh" >&2
      exit 1
    fi
  done
  echo "generated code matches proto/"
fi
