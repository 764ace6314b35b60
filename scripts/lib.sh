# Shared by the benchmark scripts that start servers of their own (ab.sh, pair.sh): source it from
# the repository root, after `cd "$(dirname "$0")/.."`.

# A free TCP port on the loopback interface.
free_port() { .venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# write_query FILE L E: a perf_analyzer --input-data file holding one [L, E] float32 query.
write_query() {
  .venv/bin/python -c 'import base64, json, sys, numpy as np
L, E = int(sys.argv[2]), int(sys.argv[3])
x = np.random.default_rng(0).standard_normal((L, E)).astype("<f4")
json.dump({"data": [{"query": {"b64": base64.b64encode(x.tobytes()).decode(), "shape": [L, E]}}]}, open(sys.argv[1], "w"))' \
    "$1" "$2" "$3"
}

# wait_healthy PID PORT LOG: waits until the server PID answers health on PORT; if it exits first,
# prints its LOG and fails.
wait_healthy() {
  until .venv/bin/attnserve health --target "127.0.0.1:$2" >/dev/null 2>&1; do
    kill -0 "$1" 2>/dev/null || { cat "$3"; return 1; }
    sleep 0.2
  done
}
