"""How fast a server settles after its load falls: latency in 250 ms windows after concurrency drops.

Keeps `--high` requests in flight for `--high-s` seconds, then `--low` for `--low-s`, through the asyncio
client, and prints each window's throughput and p50 after the drop. Lingering counts the requests in play
(batching.py); this shows how long a fallen load keeps small batches waiting for clients that left.

    attnserve serve --embed-dim 64 --num-heads 4 --port 50111 &
    .venv/bin/python scripts/load_drop.py 127.0.0.1:50111 --high 32 --low 4 --seq-len 16 --embed-dim 64
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from attnserve import AsyncClient

WINDOW_S = 0.25


async def main(args: argparse.Namespace) -> None:
    x = np.random.default_rng(0).standard_normal((args.seq_len, args.embed_dim), dtype=np.float32)
    done: list[tuple[float, float]] = []  # (when it finished, its latency), seconds
    async with AsyncClient(args.target, timeout_s=10) as client:
        for _ in range(50):
            await client.attend(x)
        start = time.perf_counter()

        async def client_loop(until: float) -> None:
            while (sent := time.perf_counter()) < until:
                await client.attend(x)
                now = time.perf_counter()
                done.append((now - start, now - sent))

        await asyncio.gather(*(client_loop(start + args.high_s) for _ in range(args.high)))
        drop = time.perf_counter() - start
        await asyncio.gather(*(client_loop(start + drop + args.low_s) for _ in range(args.low)))
    before = sum(1 for t, _ in done if t < drop)
    print(f"{args.high} in flight: {before / drop:.0f} req/s; then {args.low}:")
    print("| after the drop | req/s | p50 ms |")
    print("| --- | ---: | ---: |")
    for i in range(int(args.low_s / WINDOW_S)):
        lo = drop + i * WINDOW_S
        latencies = [latency for t, latency in done if lo <= t < lo + WINDOW_S]
        if latencies:
            p50 = statistics.median(latencies) * 1e3
            print(f"| {i * WINDOW_S:.2f}-{(i + 1) * WINDOW_S:.2f} s | {len(latencies) / WINDOW_S:.0f} | {p50:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="host:port of a running server")
    parser.add_argument("--high", type=int, default=32, help="requests in flight before the drop")
    parser.add_argument("--low", type=int, default=4, help="requests in flight after it")
    parser.add_argument("--high-s", type=float, default=3.0)
    parser.add_argument("--low-s", type=float, default=4.0)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--embed-dim", type=int, default=64, help="the served model's")
    asyncio.run(main(parser.parse_args()))
