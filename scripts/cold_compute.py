"""What one forward pass costs after the CPU paused: back to back, after a sleep, after a busy wait.

At concurrency 1 a server computes one request, then waits for the client's next: the forward pass
starts after a pause. This times the default model's forward (torch.nn.MultiheadAttention, E=256,
8 heads, one [64, 256] sequence) after each kind of pause, on one and two intra-op threads, under
OpenMP's short spin (1000 pauses) and libgomp's long one (300,000). libgomp reads its spin once, as
it loads, so each spin setting runs in a child process of its own. Prints a table of p50 / p90 µs.

    .venv/bin/python scripts/cold_compute.py [--pauses-ms 0,1,3] [--calls 600]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from attnserve_server.runtime import openmp

# The two spins `serve` sets (openmp.py): beside a GPU, and where every model computes on the CPU.
SPINS = {f"short ({openmp.GPU_SPIN_COUNT})": openmp.GPU_SPIN_COUNT, f"long ({openmp.SPIN_COUNT})": openmp.SPIN_COUNT}

_CHILD = r"""
import json, sys, time
import torch
torch.set_grad_enabled(False)
pauses, calls = json.loads(sys.argv[1]), int(sys.argv[2])
model = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
x = torch.randn(1, 64, 256)

def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass

rows = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    for kind, wait in (("sleep", time.sleep), ("busy", spin)):
        for pause_ms in pauses:
            if pause_ms == 0 and kind == "busy":
                continue
            for _ in range(50):
                model(x, x, x, need_weights=False)
            times = []
            for _ in range(calls):
                if pause_ms:
                    wait(pause_ms / 1e3)
                start = time.perf_counter()
                model(x, x, x, need_weights=False)
                times.append(time.perf_counter() - start)
            times.sort()
            rows.append([threads, "none" if pause_ms == 0 else kind, pause_ms,
                         times[calls // 2] * 1e6, times[calls * 9 // 10] * 1e6])
print(json.dumps(rows))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pauses-ms", default="0,1,3", help="pauses before each call, comma-separated (0: none)")
    ap.add_argument("--calls", type=int, default=600, help="timed calls per row")
    args = ap.parse_args()
    pauses = [float(p) for p in args.pauses_ms.split(",")]
    print("| spin | threads | pause | p50 µs | p90 µs |")
    print("| --- | ---: | --- | ---: | ---: |")
    for name, count in SPINS.items():
        env = dict(os.environ, OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT=count)
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(pauses), str(args.calls)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for threads, kind, pause_ms, p50, p90 in json.loads(out):
            pause = "none" if kind == "none" else f"{pause_ms:g} ms {kind}"
            print(f"| {name} | {threads} | {pause} | {p50:.0f} | {p90:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
