#!/usr/bin/env bash
# Where the server's CPU goes under load: py-spy (native frames, every thread) while Triton's
# perf_analyzer drives W1 over KServe v2, then a table per thread (scripts/profile_summary.py), and
# the server's own batches over the window (scripts/batch_stats.py: a batch's compute a sequence under
# load, to set beside the in-process figure).
#
#   scripts/profile.sh [OUTDIR]     env: CONC (32), SECONDS_PA (30; more than SECONDS_SPY + 4), SECONDS_SPY (12), MODE (sync|async),
#                                        E (256), H (8), L (64), DTYPE (float32: the model's, as in SERVE_ARGS),
#                                        SERVE_ARGS (extra `attnserve serve` flags),
#                                        PA_ARGS (extra perf_analyzer flags: "-b 8" sends 8 sequences a request,
#                                        and its counts, so every "per request" figure, are then per sequence),
#                                        INPUT_DATA (a perf_analyzer --input-data file instead of one [L, E] query)
#   PID=P PORT=N MODEL=mha INPUT=X scripts/profile.sh   profiles a server already running (a peer, say)
#   SPY_FLAGS=--subprocesses scripts/profile.sh   py-spy records the edge processes too (--edge-processes N),
#                                   each thread named with its process in the summary ("engine", "edge 0", ...);
#                                   on the 2-vCPU VMs py-spy 0.4.3 so crashed or hung in 5 of 6 runs while the
#                                   idle spinners' processes lived, in none of 2 with SERVE_ARGS="--idle-spin-ms 0"
#                                   (they do not spin under load anyway)
#   SPY=0 scripts/profile.sh        no py-spy: throughput, CPU per request of the server and of perf_analyzer,
#                                   and per thread its time on a CPU and waiting for one (the undisturbed
#                                   figures: on 2 vCPUs py-spy halved W1's throughput at c=32)
# Needs py-spy (`pip install py-spy`) and perf_analyzer (scripts/perf_analyzer.sh --setup).
# Requests per second come from perf_analyzer's own count over its whole window.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.cache/profile-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
VENV=${ATTNSERVE_VENV:-.venv}
CONC=${CONC:-32} SECONDS_PA=${SECONDS_PA:-30} SECONDS_SPY=${SECONDS_SPY:-12} MODE=${MODE:-sync}
E=${E:-256} H=${H:-8} L=${L:-64} DTYPE=${DTYPE:-float32}
PA=$(scripts/perf_analyzer.sh --setup)
CUDART=$(ls -d .cache/perf-venv/lib/python3*/site-packages/nvidia/cuda_runtime/lib)
MODEL=${MODEL:-default} INPUT=${INPUT:-query}

if [ -n "${INPUT_DATA:-}" ]; then
  cp "$INPUT_DATA" "$OUT/query.json"
else
  # the bytes of the model's own dtype, which perf_analyzer reads from its metadata; bfloat16: float32's high half
  "$VENV/bin/python" -c 'import base64, json, sys, numpy as np
L, E, dtype = int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
x = np.random.default_rng(0).standard_normal((L, E)).astype("<f4")
x = (x.view("<u4") >> 16).astype("<u2") if dtype == "bfloat16" else x.astype(np.dtype(dtype).newbyteorder("<"))
json.dump({"data": [{sys.argv[4]: {"b64": base64.b64encode(x.tobytes()).decode(), "shape": [L, E]}}]}, open(sys.argv[1], "w"))' \
    "$OUT/query.json" "$L" "$E" "$INPUT" "$DTYPE"
fi

if [ -z "${PID:-}" ]; then
  PORT=$("$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  # shellcheck disable=SC2086
  "$VENV/bin/attnserve" serve --host 127.0.0.1 --port "$PORT" --metrics-port -1 --embed-dim "$E" --num-heads "$H" \
    ${SERVE_ARGS:-} >"$OUT/server.log" 2>&1 &
  PID=$!
  trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null' EXIT
  until "$VENV/bin/attnserve" health --target "127.0.0.1:$PORT" >/dev/null 2>&1; do
    kill -0 $PID || { cat "$OUT/server.log"; exit 1; }
    sleep 0.5
  done
fi

MODE_FLAG=()
[ "$MODE" = async ] && MODE_FLAG=(--async)
# shellcheck disable=SC2086 # PA_ARGS: words on purpose
LD_LIBRARY_PATH=$CUDART "$PA" -m "$MODEL" -u "127.0.0.1:$PORT" -i grpc --input-data "$OUT/query.json" \
  --concurrency-range "$CONC:$CONC" --measurement-interval $((SECONDS_PA * 1000 / 3)) -s 1000 -r 3 \
  "${MODE_FLAG[@]}" ${PA_ARGS:-} >"$OUT/perf_analyzer.log" 2>&1 &
LOAD=$!
# utime + stime of every thread of the server process and of its children (edge processes)
cpu_ticks() { for p in $PID $(pgrep -P "$PID"); do awk '{print $14 + $15}' "/proc/$p/stat"; done | awk '{s += $1} END {print s}'; }
# per thread, from the scheduler's own accounting (/proc/.../schedstat, nanoseconds): "pid/tid name
# on-CPU waiting-for-a-CPU timeslices" (a name's spaces as _). The wait is time runnable but not running:
# on 2 vCPUs, where the threads of the server and of the load generator outnumber the cores, it says
# who queues behind whom, which CPU time alone cannot.
thread_sched() {
  for p in $PID $(pgrep -P "$PID"); do
    for t in /proc/"$p"/task/*; do
      echo "$p/${t##*/} $(tr ' ' _ <"$t/comm" 2>/dev/null) $(cat "$t/schedstat" 2>/dev/null)"
    done
  done | awk 'NF == 5' | sort
}
# the load generator's own CPU (utime + stime ticks, every thread): what a request costs the client
load_ticks() { awk '{print $14 + $15}' "/proc/$LOAD/stat" 2>/dev/null || echo 0; }
# the server's own batch statistics (KServe v2), read just outside the window: what a batch's compute costs under load
batch_stats() { "$VENV/bin/python" scripts/batch_stats.py snapshot "127.0.0.1:$PORT" "$MODEL" >"$1" 2>>"$OUT/batch_stats.log" || echo '{}' >"$1"; }
sleep 4 # perf_analyzer's warm-up
batch_stats "$OUT/batch-stats-0.json"
t0=$(date +%s.%N) c0=$(cpu_ticks) l0=$(load_ticks)
thread_sched >"$OUT/threads-0.txt"
if [ "${SPY:-1}" = 1 ]; then
  # bounded: with --subprocesses, py-spy once sampled on for 10 minutes past its -d (see SPY_FLAGS above)
  if ! timeout --foreground "$((SECONDS_SPY + 30))" py-spy record --pid "$PID" ${SPY_FLAGS:-} --threads --idle --native --rate 100 \
    -d "$SECONDS_SPY" --format raw -o "$OUT/profile.txt" >"$OUT/py-spy.log" 2>&1; then
    echo "profile.sh: py-spy failed or ran 30 s past its ${SECONDS_SPY} s (see $OUT/py-spy.log)" >&2
    exit 1
  fi
else
  sleep "$SECONDS_SPY"
fi
t1=$(date +%s.%N) c1=$(cpu_ticks) l1=$(load_ticks)
if ! kill -0 "$LOAD" 2>/dev/null; then
  # Its CPU and the server's busy time would be read over a window that was partly idle.
  echo "profile.sh: perf_analyzer ended before the recording did: give SECONDS_PA more than SECONDS_SPY + 4" >&2
  exit 1
fi
thread_sched >"$OUT/threads-1.txt"
batch_stats "$OUT/batch-stats-1.json"
wait $LOAD || true
rate=$(awk '/Throughput:/ {print int($(NF-1))}' "$OUT/perf_analyzer.log" | tail -n 1)
[ -n "$rate" ] || { cat "$OUT/perf_analyzer.log"; exit 1; }
requests=$((rate * SECONDS_SPY))
echo "perf_analyzer: $rate req/s at concurrency $CONC ($MODE); about $requests requests while recording" | tee "$OUT/summary.md"
python3 -c "import sys; t0, t1, c, r, hz = map(float, sys.argv[1:]); t = t1 - t0
print(f'server processes: {c / hz / t:.2f} cores busy, {1e6 * c / hz / (r * t):.0f} us CPU per request')" \
  "$t0" "$t1" "$((c1 - c0))" "$rate" "$(getconf CLK_TCK)" | tee -a "$OUT/summary.md"
python3 -c "import sys; l, r, t, hz = map(float, sys.argv[1:]); print(f'perf_analyzer: {1e6 * l / hz / (r * t):.0f} us CPU per request')" \
  "$((l1 - l0))" "$rate" "$(python3 -c "print($t1 - $t0)")" "$(getconf CLK_TCK)" | tee -a "$OUT/summary.md"
# Each thread's time on a CPU and waiting for one, per request (without py-spy, the undisturbed figures)
join "$OUT/threads-0.txt" "$OUT/threads-1.txt" | awk -v r="$rate" -v t="$(python3 -c "print($t1 - $t0)")" \
  'BEGIN {print "| thread | us on a CPU per request | us waiting for one | timeslices per request |"; print "| --- | ---: | ---: | ---: |"}
   $7 > $3 || $8 > $4 {n = r * t; printf "| %s (%s) | %.0f | %.0f | %.2f |\n", $2, $1, ($7 - $3) / 1e3 / n, ($8 - $4) / 1e3 / n, ($9 - $5) / n}' \
  | tee -a "$OUT/summary.md"
echo "The server's batches in the window (its KServe statistics; wall clock of a batch over its sequences):" | tee -a "$OUT/summary.md"
"$VENV/bin/python" scripts/batch_stats.py diff "$OUT/batch-stats-0.json" "$OUT/batch-stats-1.json" --min-batches 20 \
  | tee -a "$OUT/summary.md"
[ "${SPY:-1}" = 1 ] && "$VENV/bin/python" scripts/profile_summary.py "$OUT/profile.txt" --requests "$requests" | tee -a "$OUT/summary.md"
grep -E "Throughput|p50 latency|p99 latency" "$OUT/perf_analyzer.log" | tee -a "$OUT/summary.md" || true
echo "profile in $OUT"
