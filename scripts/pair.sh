#!/usr/bin/env bash
# A paired A/B on a noisy machine: two servers run at once, and perf_analyzer (KServe v2, sync unless
# PA_FLAGS say otherwise) drives them in turn, A then B, then B then A, N times. The host's slow and
# fast phases then fall on both arms alike; compare the pairs, not runs minutes apart. The idle server
# sleeps meanwhile (its idle spinners stop 2 ms after its last request).
# Prints one line per pair: "req/s/p50 µs" of each arm, then the medians of B/A over the pairs.
#
#   A="VAR=x ..." B="VAR=y ..." ARGS_A="serve flags" ARGS_B="serve flags" scripts/pair.sh
#   (A and B go before the server command through env: variables, or a command, e.g. B="taskset -c 0")
#   env: C (concurrency, 1), N (pairs, 6), L / E / H (query length, width, heads: 64 / 256 / 8),
#        PA_MS (window, ms: 2000; perf_analyzer reports the mean of three), PA_FLAGS (more perf_analyzer
#        flags, e.g. --async),
#        PEER_A (inline, batcher, echo or pytriton: arm A is that peer server of ../shared/peers instead,
#        the same shape on 2 intra-op threads, after ../shared/peers/setup.sh; pytriton is Triton 2.51's
#        dynamic batcher, max 64 and 500 us as compare.sh runs it; A and ARGS_A then do not apply)
#        PRE_C (a concurrency: each arm first runs a window at it, not counted, right before its measured
#        one: what a server carries from one load into the next, as compare.sh's c=1 before its c=8),
#        INPUT_DATA (a perf_analyzer --input-data file instead of one [L, E] query: cross attention's
#        query and key_value, say; attnserve arms only)
# e.g. B="OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=1000" C=1 L=256 scripts/pair.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
OUT=$(mktemp -d)
L=${L:-64} E=${E:-256} H=${H:-8}
scripts/perf_analyzer.sh --setup >/dev/null
if [ -n "${INPUT_DATA:-}" ]; then cp "$INPUT_DATA" "$OUT/query.json"; else write_query "$OUT/query.json" "$L" "$E"; fi
PORT_A=$(free_port)
PORT_B=$(free_port)
if [ -n "${PEER_A:-}" ]; then
  PEERS=$(cd ../shared/peers && pwd)
  PEERS_HOME=${PEERS_HOME:-$HOME/.cache/attnserve-peers}
  PEERS_PY=$PEERS_HOME/base/bin/python
fi
if [ "${PEER_A:-}" = pytriton ]; then
  TRITON_PY=$PEERS_HOME/pytriton/bin/python
  HTTP_A=$(free_port) METRICS_A=$(free_port) # Triton's other two ports, unused
  # its own session (setsid), so that the tritonserver it starts stops with it (stop_peer)
  (cd "$PEERS" && PEERS_E=$E PEERS_H=$H PEERS_L=$L MHA_TORCH_THREADS=2 \
    LD_LIBRARY_PATH=$("$TRITON_PY" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))') \
    exec setsid "$TRITON_PY" pytriton_server.py --grpc-port "$PORT_A" --http-port "$HTTP_A" \
    --metrics-port "$METRICS_A" --delay-us 500) >"$OUT/a.log" 2>&1 &
  SA=$!
elif [ -n "${PEER_A:-}" ]; then
  (cd "$PEERS" && PEERS_E=$E PEERS_H=$H PEERS_L=$L MHA_TORCH_THREADS=2 \
    exec "$PEERS_PY" baseline_server.py --mode "$(echo "$PEER_A" | sed 's/^inline$/naive/; s/^batcher$/dynamic/')" \
    --port "$PORT_A") >"$OUT/a.log" 2>&1 &
  SA=$!
else
  # shellcheck disable=SC2086 # the arms' variables and flags are words on purpose
  env ${A:-} .venv/bin/attnserve serve --host 127.0.0.1 --port "$PORT_A" --metrics-port -1 --embed-dim "$E" \
    --num-heads "$H" ${ARGS_A:-} >"$OUT/a.log" 2>&1 &
  SA=$!
fi
# shellcheck disable=SC2086
env ${B:-} .venv/bin/attnserve serve --host 127.0.0.1 --port "$PORT_B" --metrics-port -1 --embed-dim "$E" \
  --num-heads "$H" ${ARGS_B:-} >"$OUT/b.log" 2>&1 &
SB=$!
# A PyTriton peer leads its own session: every process in it goes (tritonserver among them).
stop_peer() {
  if [ "${PEER_A:-}" = pytriton ]; then
    for p in $(ps -o pid= -s "$SA" 2>/dev/null); do kill "$p" 2>/dev/null || true; done
  fi
}
# Each step may fail (a server already gone): under set -e a failure would end the trap there.
trap 'stop_peer; kill $SA $SB 2>/dev/null || true; wait $SA $SB 2>/dev/null || true; rm -rf "$OUT"' EXIT
if [ -n "${PEER_A:-}" ]; then
  PEERS_E=$E PEERS_L=$L PROBE_MODEL=mha "$PEERS_PY" "$PEERS/probe.py" "127.0.0.1:$PORT_A" 240 >/dev/null || { cat "$OUT/a.log"; exit 1; }
else
  wait_healthy $SA "$PORT_A" "$OUT/a.log"
fi
wait_healthy $SB "$PORT_B" "$OUT/b.log"
one() {  # PORT: the arm's "req/s/p50 µs"
  [ -n "${PRE_C:-}" ] && C=$PRE_C PRE_C= one "$1" >/dev/null
  local data=(-m default --input-data "$OUT/query.json")
  [ -n "${PEER_A:-}" ] && [ "$1" = "$PORT_A" ] && data=(-m mha --shape "X:$L,$E")
  # shellcheck disable=SC2086 # PA_FLAGS are words on purpose
  scripts/perf_analyzer.sh --run "${data[@]}" -u "127.0.0.1:$1" -i grpc \
    --concurrency-range "${C:-1}:${C:-1}" --measurement-interval "${PA_MS:-2000}" -s 1000 -r 3 ${PA_FLAGS:-} 2>&1 |
    awk '/Throughput:/ {t = $2} /p50 latency:/ {p = $3} END {printf "%d/%s", t, p}'
}
for i in $(seq "${N:-6}"); do
  if [ $((i % 2)) = 1 ]; then a=$(one "$PORT_A"); b=$(one "$PORT_B"); else b=$(one "$PORT_B"); a=$(one "$PORT_A"); fi
  echo "A $a  B $b" | tee -a "$OUT/pairs"
done
# The pairs' medians of B/A, and how many pairs B won: two identical arms read 0.96-1.00 over 10 pairs
# of 0.7 s windows on the VM of BENCHMARKS.md (nineteenth pass), so trust a median further from 1.
# A run starts each arm's server once, and a server process can stay a few percent faster or slower for
# its whole life: identical arms read 0.965 and 0.977, B lower in 4 and 3 of 4 pairs (fifty-fifth pass). For an
# effect under ~5%, repeat the run (fresh servers each time) and take the median of the runs' medians.
.venv/bin/python - "$OUT/pairs" <<'PY'
import statistics, sys
pairs = [[[float(x) for x in arm.split("/")] for arm in line.split()[1::2]] for line in open(sys.argv[1])]
pairs = [(a, b) for a, b in pairs if a[0] > 0 and b[0] > 0 and a[1] > 0 and b[1] > 0]
if pairs:
    rate = [b[0] / a[0] for a, b in pairs]
    p50 = [b[1] / a[1] for a, b in pairs]
    print(f"{len(pairs)} pairs: req/s B/A median {statistics.median(rate):.3f} (B higher in {sum(r > 1 for r in rate)}), "
          f"p50 B/A median {statistics.median(p50):.3f} (B lower in {sum(r < 1 for r in p50)})")
PY
