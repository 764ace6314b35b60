"""Draws a ../shared/peers/compare.sh run with `attnserve bench --plot`'s chart: throughput against
p50 and p99 latency, one line per server, the median of the rounds at each concurrency.

    python scripts/plot_peers.py .cache/peers-YYYYmmdd-HHMMSS docs/peers-w1.png "title"
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from attnserve_bench.results import Row, plot


def main(run: str, out: str, title: str) -> None:
    levels: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for line in Path(run, "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("rc") == 0:
            levels[(r["label"].rsplit("-r", 1)[0], r["concurrency"])].append(r)
    rows = []
    for (server, concurrency), rounds in levels.items():
        ordered = sorted(rounds, key=lambda r: r["req_per_s"])
        median = ordered[(len(ordered) - 1) // 2]  # the round of the (lower) median throughput
        rows.append(Row(server, concurrency, 0, 0, median["req_per_s"], median["p50_ms"], 0.0, median["p99_ms"], 0.0))
    plot(rows, out, title)


if __name__ == "__main__":
    main(*sys.argv[1:4])
