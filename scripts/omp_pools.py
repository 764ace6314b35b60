"""What an OpenMP pool on the main thread costs the device worker (W1, one sequence, CPU).

The worker computes on a thread of its own, as in the server. Each case runs in a fresh process
(a pool, once made, lasts as long as its thread) and times `DeviceWorker.run` on the worker's
thread before and after one torch parallel region elsewhere: nowhere, on another live thread,
or on the main thread (where the event loop runs in the server).

    .venv/bin/python scripts/omp_pools.py            # prints a table, medians in µs per batch
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

CASES = ("nowhere", "another thread", "main thread")


def measure(case: str) -> tuple[float, float]:
    from concurrent.futures import ThreadPoolExecutor

    from attnserve_server.runtime import openmp

    openmp.set_defaults(os.environ)  # as `attnserve serve` does: before torch (and libgomp) loads
    import torch
    from cpu_worker import cpu_worker

    from attnserve_server.settings import ModelSettings

    worker_thread, worker = cpu_worker(ModelSettings())
    request = worker.example_request(64)

    def median_us() -> float:
        times = []
        for _ in range(300):
            start = time.perf_counter()
            worker.run([request])
            times.append(time.perf_counter() - start)
            pause = time.perf_counter() + 0.0005  # a gap between requests, as at concurrency 1
            while time.perf_counter() < pause:
                pass
        return statistics.median(times[30:]) * 1e6

    before = worker_thread.submit(median_us).result()
    if case == "another thread":
        other = ThreadPoolExecutor(1)  # stays alive, as the event loop's default executor does
        other.submit(lambda: torch.randn(4_000_000).sum()).result()
    elif case == "main thread":
        torch.randn(4_000_000).sum()
    after = worker_thread.submit(median_us).result()
    return before, after


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        before, after = measure(sys.argv[2])
        print(f"{before:.0f} {after:.0f}")
        return
    print("| parallel region run on | worker µs per batch, before | after |")
    print("| --- | ---: | ---: |")
    for case in CASES:
        out = subprocess.run(
            [sys.executable, __file__, "--case", case], capture_output=True, text=True, check=True
        ).stdout.split()
        print(f"| {case} | {out[0]} | {out[1]} |")


if __name__ == "__main__":
    main()
