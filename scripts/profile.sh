#!/usr/bin/env bash
# Where the server's CPU goes under load: py-spy (native frames, every thread) while Triton's
# perf_analyzer drives W1 over KServe v2, then a table per thread (scripts/profile_summary.py).
#
#   scripts/profile.sh [OUTDIR]     env: CONC (32), SECONDS_PA (30), SECONDS_SPY (12), MODE (sync|async),
#                                        E (256), H (8), L (64), SERVE_ARGS (extra `attnserve serve` flags)
# Needs py-spy (`pip install py-spy`) and perf_analyzer (scripts/perf_analyzer.sh --setup).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.cache/profile-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
VENV=${ATTNSERVE_VENV:-.venv}
CONC=${CONC:-32} SECONDS_PA=${SECONDS_PA:-30} SECONDS_SPY=${SECONDS_SPY:-12} MODE=${MODE:-sync}
E=${E:-256} H=${H:-8} L=${L:-64}
PA=$(scripts/perf_analyzer.sh --setup)
CUDART=$(ls -d .cache/perf-venv/lib/python3*/site-packages/nvidia/cuda_runtime/lib)
PORT=$("$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

"$VENV/bin/python" -c 'import base64, json, sys, numpy as np
L, E = int(sys.argv[2]), int(sys.argv[3])
x = np.random.default_rng(0).standard_normal((L, E)).astype("<f4")
json.dump({"data": [{"query": {"b64": base64.b64encode(x.tobytes()).decode(), "shape": [L, E]}}]}, open(sys.argv[1], "w"))' \
  "$OUT/query.json" "$L" "$E"

# shellcheck disable=SC2086
"$VENV/bin/attnserve" serve --host 127.0.0.1 --port "$PORT" --metrics-port -1 --embed-dim "$E" --num-heads "$H" \
  ${SERVE_ARGS:-} >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
until "$VENV/bin/attnserve" health --target "127.0.0.1:$PORT" >/dev/null 2>&1; do
  kill -0 $SERVER || { cat "$OUT/server.log"; exit 1; }
  sleep 0.5
done

count() {
  "$VENV/bin/python" -c 'import sys, tritonclient.grpc as g
s = g.InferenceServerClient(sys.argv[1]).get_inference_statistics("default").model_stats[0]
print(s.inference_stats.success.count)' "127.0.0.1:$PORT"
}

MODE_FLAG=()
[ "$MODE" = async ] && MODE_FLAG=(--async)
LD_LIBRARY_PATH=$CUDART "$PA" -m default -u "127.0.0.1:$PORT" -i grpc --input-data "$OUT/query.json" \
  --concurrency-range "$CONC:$CONC" --measurement-interval $((SECONDS_PA * 1000)) -s 1000 -r 1 \
  "${MODE_FLAG[@]}" >"$OUT/perf_analyzer.log" 2>&1 &
LOAD=$!
sleep 4 # perf_analyzer's warm-up
before=$(count)
py-spy record --pid $SERVER --threads --idle --native --rate 100 -d "$SECONDS_SPY" --format raw \
  -o "$OUT/profile.txt" >"$OUT/py-spy.log" 2>&1
after=$(count)
wait $LOAD || true
requests=$((after - before))
echo "requests answered while recording: $requests in ${SECONDS_SPY} s ($((requests / SECONDS_SPY)) req/s)" | tee "$OUT/summary.md"
"$VENV/bin/python" scripts/profile_summary.py "$OUT/profile.txt" --requests "$requests" | tee -a "$OUT/summary.md"
grep -E "Throughput|p50 latency|p99 latency" "$OUT/perf_analyzer.log" | tee -a "$OUT/summary.md" || true
echo "profile in $OUT"
