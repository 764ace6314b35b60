#!/usr/bin/env bash
# One A/B arm: starts a server, drives it with perf_analyzer (KServe v2, sync) at each concurrency in
# turn, and prints req/s, p50, and from the server's own metrics the worker's wall time per request
# (attnserve_compute_duration_seconds over attnserve_batch_requests) and the mean batch. Alternate
# arms (A B B A ...) on this noisy machine and compare medians.
#
#   scripts/ab.sh CONCURRENCIES [serve flags]        e.g. scripts/ab.sh 1,8,32 --max-batch-size 1
#   env: ATTNSERVE (the command; default .venv/bin/attnserve: point it at a wrapper that runs another
#        checkout), QUERY (a perf_analyzer --input-data file; default one [64, 256] fp32 query),
#        PA_MS (measurement window, ms; default 4000)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
CONCS=$1
shift
ATTNSERVE=${ATTNSERVE:-.venv/bin/attnserve}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
scripts/perf_analyzer.sh --setup >/dev/null
if [ -n "${QUERY:-}" ]; then
  [ -f "$QUERY" ] || { echo "ab.sh: no query file $QUERY" >&2; exit 1; }
else
  QUERY=$OUT/query.json
  write_query "$QUERY" 64 256
fi
PORT=$(free_port)
MPORT=$(free_port)
"$ATTNSERVE" serve --host 127.0.0.1 --port "$PORT" --metrics-port "$MPORT" "$@" >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -rf "$OUT"' EXIT
wait_healthy $SERVER "$PORT" "$OUT/server.log"
scrape() { curl -sf "http://127.0.0.1:$MPORT/metrics"; }
for c in ${CONCS//,/ }; do
  scrape >"$OUT/before"
  scripts/perf_analyzer.sh --run -m default -u "127.0.0.1:$PORT" -i grpc --input-data "$QUERY" \
    --concurrency-range "$c:$c" --measurement-interval "${PA_MS:-4000}" >"$OUT/pa" 2>&1
  scrape >"$OUT/after"
  .venv/bin/python - "$c" "$OUT" <<'EOF'
import re, sys
c, out = sys.argv[1], sys.argv[2]
def total(name: str, which: str) -> float:
    text = open(f"{out}/{which}").read()
    return sum(float(v) for v in re.findall(rf'^{name}{{[^}}]*model="default"[^}}]*}} (\S+)$', text, re.M))
def delta(name: str) -> float:
    return total(name, "after") - total(name, "before")
pa = open(f"{out}/pa").read()
rate = re.findall(r"Throughput: ([\d.]+) infer/sec", pa)[-1]
p50 = re.findall(r"p50 latency: (\d+) usec", pa)[-1]
requests, batches = delta("attnserve_batch_requests_sum"), delta("attnserve_batch_requests_count")
wall = delta("attnserve_compute_duration_seconds_sum") / requests * 1e6
print(f"c={c} req/s {float(rate):.0f} p50 {p50} us worker wall/request {wall:.0f} us mean batch {requests / batches:.1f}")
EOF
done
