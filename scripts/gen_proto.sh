#!/usr/bin/env bash
# Generates the Python protobuf/gRPC code from proto/; --check fails on drift.
#   proto/attnserve/v1/*.proto                 -> client/attnserve/v1/  (the native API, in the client package)
#   proto/attnserve_server/protocol/*.proto    -> server/attnserve_server/protocol/  (KServe v2, server only)
#
# protoc is pinned (grpcio-tools 1.71.2, protoc 29 -> gencode 5.29) and installed
# into .cache/ apart from the project's environment: the gencode version sets the
# oldest protobuf runtime that can load it, so an old protoc keeps the floor low.
#
# The KServe v2 messages live in package `inference`, as Triton's do, and so does
# tritonclient's own generated code. Two different files defining the same symbols
# cannot share protobuf's default descriptor pool, so ours is generated into a
# private pool: a process may import attnserve_server and tritonclient together.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS_VERSION=1.71.2
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
# grpcio-tools is compiled per interpreter: one directory per Python version.
TOOLS_DIR=.cache/grpcio-tools-$TOOLS_VERSION-$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
if [ ! -d "$TOOLS_DIR/grpc_tools" ]; then
  "$PY" -m pip install -q --no-deps --target "$TOOLS_DIR" "grpcio-tools==$TOOLS_VERSION"
fi
check=false
[ "${1:-}" = "--check" ] && check=true
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

generate() { # <proto file> <output root>
  PYTHONPATH="$TOOLS_DIR" "$PY" -m grpc_tools.protoc -I proto \
    --python_out="$2" --pyi_out="$2" --grpc_python_out="$2" "$1"
}
mkdir -p "$tmp/client" "$tmp/server"
generate attnserve/v1/attention.proto "$tmp/client"
generate attnserve_server/protocol/open_inference.proto "$tmp/server"
sed -i 's/_descriptor_pool\.Default()\.AddSerializedFile(/_descriptor_pool.DescriptorPool().AddSerializedFile(/' \
  "$tmp/server/attnserve_server/protocol/open_inference_pb2.py"
grep -q '_descriptor_pool.DescriptorPool().AddSerializedFile(' \
  "$tmp/server/attnserve_server/protocol/open_inference_pb2.py" ||
  { echo "gen_proto: could not move open_inference_pb2 into a private descriptor pool" >&2; exit 1; }

stale=0
for pair in client:attnserve/v1/attention server:attnserve_server/protocol/open_inference; do
  root=${pair%%:*} stem=${pair#*:}
  for suffix in _pb2.py _pb2.pyi _pb2_grpc.py; do
    generated="$tmp/$root/$stem$suffix" committed="$root/$stem$suffix"
    if $check; then
      if ! cmp -s "$generated" "$committed"; then
        echo "generated code is stale: $committed differs from proto/; run scripts/gen_proto.sh" >&2
        stale=1
      fi
    else
      cp "$generated" "$committed"
    fi
  done
done
if $check; then
  [ "$stale" = 0 ] && echo "generated code matches proto/"
  exit "$stale"
fi
