"""Where the host runs this VM's two vCPUs right now, and what that does to two intra-op threads.

A 2-vCPU VM's vCPUs are threads on the host, and the host moves them: onto two cores of one L3
complex, onto two complexes, or onto the two hyperthreads of one core. Nothing in the guest says
which (lscpu shows two "cores" throughout), but a cache line handed between them does: back and
forth between two threads pinned to CPU 0 and CPU 1, spinning, a round trip took 60-70 ns on one
core's two hyperthreads, 110-130 ns on two cores of one complex and 330-420 ns across complexes on
the AMD EPYC (Zen 4) VM of BENCHMARKS.md (sixty-third pass). Each sample here gives that round trip
(a small C program, built with the system's C compiler) beside the time of W1's forward pass (E=256,
8 heads, L=64) on one intra-op thread and on two, in-process, with the server's OpenMP spin: on
two cores of one complex two threads took ~355 µs against one's ~525; on one core's hyperthreads
~570 against ~535, slower than one; across complexes 440-650.

So a benchmark whose arms run minutes apart may compare placements, not code, and the server's
thread choice (compute/threads.py) changes with them, as it should: it measures.

    .venv/bin/python scripts/vcpu_placement.py                 # a sample a second for 30 s
    .venv/bin/python scripts/vcpu_placement.py --seconds 120 --every 0.5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PING_PONG_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static volatile long flag, ack;
static volatile int stop;
static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}
static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}
static void *partner(void *arg) {
    long seen = 0;
    pin(1);
    while (!stop) { while (flag == seen && !stop) __builtin_ia32_pause(); seen = flag; ack = seen; }
    return arg;
}
static int by_value(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return (x > y) - (x < y);
}
int main(void) {
    enum { ROUNDS = 4000 };
    static long trip[ROUNDS];
    pthread_t thread;
    pin(0);
    pthread_create(&thread, 0, partner, 0);
    for (int i = 0; i < ROUNDS; i++) {
        long t = now_ns(), f = flag + 1;
        flag = f;
        while (ack != f) {}
        trip[i] = now_ns() - t;
    }
    stop = 1;
    pthread_join(thread, 0);
    qsort(trip, ROUNDS, sizeof trip[0], by_value);
    printf("%ld\n", trip[ROUNDS / 2]);
    return 0;
}
"""


def build_ping_pong(directory: Path) -> Path | None:
    """The ping-pong program, built in `directory`; None where there is no C compiler or no x86 pause."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source, program = directory / "ping_pong.c", directory / "ping_pong"
    source.write_text(PING_PONG_C)
    built = subprocess.run([compiler, "-O2", "-pthread", "-o", str(program), str(source)], capture_output=True)
    return program if built.returncode == 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long to sample (default 30)")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples (default 1)")
    args = parser.parse_args()
    if not {0, 1} <= os.sched_getaffinity(0):
        print("needs CPUs 0 and 1", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
    from attnserve_server.runtime import openmp

    openmp.set_defaults(os.environ)  # the server's spin, before torch loads
    import torch

    worker = ThreadPoolExecutor(1)  # torch computes on a thread of its own, as in the server (scripts/omp_pools.py)

    def build():
        torch.manual_seed(0)
        return torch.nn.MultiheadAttention(256, 8, batch_first=True).eval(), torch.randn(1, 64, 256)

    module, x = worker.submit(build).result()

    def forward_us(threads: int, runs: int = 60) -> float:
        torch.set_num_threads(threads)
        times = []
        with torch.inference_mode():
            for _ in range(runs):
                start = time.perf_counter()
                module(x, x, x, need_weights=False)
                times.append(time.perf_counter() - start)
                time.sleep(0.0007)  # the gap between requests at concurrency 1
        return statistics.median(times) * 1e6

    with tempfile.TemporaryDirectory() as directory:
        program = build_ping_pong(Path(directory))
        print("| time | CPU 0 <-> 1 round trip, ns | W1 one thread, µs | two threads, µs | two / one |")
        print("| --- | ---: | ---: | ---: | ---: |")
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            trip = subprocess.run([program], capture_output=True, text=True).stdout.strip() if program else "n/a"
            one = worker.submit(forward_us, 1).result()
            two = worker.submit(forward_us, 2).result()
            print(f"| {time.strftime('%H:%M:%S')} | {trip} | {one:.0f} | {two:.0f} | {two / one:.2f} |", flush=True)
            time.sleep(args.every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
