"""What waking another thread costs on this machine: the number behind compute/threads.py's floor.

Two Python threads hand a token back and forth (threading.Event), as the event loop and a worker do
when a request hops between them, and as libgomp's threads do at a parallel region their spin did
not bridge. Each round trip is two wakes. Measured with the threads free to run on any CPU (each
wake then usually lands on the other core) and with both pinned to one CPU (a wake is a context
switch there), back to back and with a busy gap between rounds, as between requests.

    .venv/bin/python scripts/thread_wakes.py         # prints a table, µs per round trip
"""

from __future__ import annotations

import os
import threading
import time

ROUNDS = 2000


def round_trips(gap_s: float) -> list[float]:
    ping, pong = threading.Event(), threading.Event()

    def other() -> None:
        for _ in range(ROUNDS):
            ping.wait()
            ping.clear()
            pong.set()

    thread = threading.Thread(target=other)
    thread.start()
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        ping.set()
        pong.wait()
        pong.clear()
        times.append(time.perf_counter() - start)
        until = time.perf_counter() + gap_s
        while time.perf_counter() < until:
            pass
    thread.join()
    return times


def main() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    print(f"{len(cpus)} CPUs; {ROUNDS} round trips each; µs")
    print("| threads on | gap between rounds | p10 | p50 | p90 |")
    print("| --- | --- | ---: | ---: | ---: |")
    for pinned in (False, True):
        os.sched_setaffinity(0, {cpus[0]} if pinned else set(cpus))  # threads started later inherit it
        for gap_us in (0, 500):
            times = sorted(t * 1e6 for t in round_trips(gap_us / 1e6))
            p10, p50, p90 = (times[int(q * len(times))] for q in (0.1, 0.5, 0.9))
            where = f"CPU {cpus[0]}" if pinned else "any CPU"
            print(f"| {where} | {gap_us} µs | {p10:.0f} | {p50:.0f} | {p90:.0f} |")
    os.sched_setaffinity(0, set(cpus))


if __name__ == "__main__":
    main()
