"""What glibc's malloc settings cost the device worker over a stream of batches of mixed sizes (CPU).

Each case runs in a fresh process (malloc's state builds up over a run) and times `DeviceWorker.run`
on the worker's own thread, as in the server, over batches of 1-24 single-sequence requests drawn at
random (one seed for every case), with the OpenMP setting the server runs under. Cases: glibc's
default, and `serve`'s settings (attnserve_server/allocator.py). Prints µs per sequence and the
process's minor page faults and its peak resident memory.

    .venv/bin/python scripts/malloc_batches.py                 # E=256, 8 heads, L = 64, 128, 256
    .venv/bin/python scripts/malloc_batches.py --lengths 256 --embed-dim 1024 --num-heads 16
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import subprocess
import sys
import time

CASES = ("glibc default", "serve's settings")


def measure(case: str, length: int, embed_dim: int, num_heads: int) -> tuple[float, int, int]:
    from attnserve_server.runtime import allocator, openmp

    openmp.set_defaults(os.environ)
    if case == CASES[1]:
        allocator.set_defaults(os.environ)
    from cpu_worker import cpu_worker

    from attnserve_server.settings import BatchingSettings, ModelSettings

    settings = ModelSettings(
        embed_dim=embed_dim,
        num_heads=num_heads,
        max_query_len=length,
        max_key_len=length,
        batching=BatchingSettings(max_batch_size=24, max_batch_tokens=24 * length),
    )
    thread, worker = cpu_worker(settings)
    rng = random.Random(0)
    sizes = [rng.randint(1, 24) for _ in range(max(60, 30_000 // length))]
    requests = [worker.example_request(length) for _ in range(24)]

    def run() -> tuple[float, int]:
        for size in (1, 8, 24):  # warm-up
            worker.run(requests[:size])
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        for size in sizes:
            worker.run(requests[:size])
        elapsed = time.perf_counter() - start
        return elapsed / sum(sizes) * 1e6, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    us, faults = thread.submit(run).result()
    return us, faults, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="64,128,256", help="query lengths, comma separated")
    parser.add_argument("--embed-dim", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case is not None:
        us, faults, rss = measure(args.case, int(args.lengths), args.embed_dim, args.num_heads)
        print(f"{us:.0f} {faults} {rss}")
        return
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    print(f"E={args.embed_dim}, {args.num_heads} heads, batches of 1-24 sequences")
    print("| L | malloc | µs per sequence | page faults | peak RSS MiB |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for length in args.lengths.split(","):
        for case in CASES:
            command = [sys.executable, __file__, "--case", case, "--lengths", length]
            command += ["--embed-dim", str(args.embed_dim), "--num-heads", str(args.num_heads)]
            us, faults, rss = subprocess.run(
                command, env=clean, capture_output=True, text=True, check=True
            ).stdout.split()
            print(f"| {length} | {case} | {us} | {faults} | {rss} |", flush=True)


if __name__ == "__main__":
    main()
