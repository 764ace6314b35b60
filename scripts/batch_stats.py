"""What a server's batches cost under load, from its own KServe v2 statistics over a window.

    python scripts/batch_stats.py snapshot HOST:PORT MODEL > before.json
    ... load ...
    python scripts/batch_stats.py snapshot HOST:PORT MODEL > after.json
    python scripts/batch_stats.py diff before.json after.json [--min-batches N]

`ModelStatistics` (attnserve's, or Triton's) counts each batch size's executions and their wall-clock
time staging inputs, computing and handing results back. Their difference over a window gives, per
batch size, the compute a sequence took *under load*, to set beside the in-process figure for a batch
of that size: where the two agree, the worker's compute ran at its undisturbed rate and what the load
costs lies elsewhere (waiting for a CPU, the edge); where the loaded one is larger, the compute itself
was slowed (BENCHMARKS.md, seventy-third pass). `scripts/profile.sh` takes both snapshots around its
window. A server without ModelStatistics (the peers' minimal servers) gives an empty snapshot.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

PHASES = ("compute_input", "compute_infer", "compute_output")


def snapshot(target: str, model: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """{"executions": {batch size: {phase: [count, ns]}}} since the server started; {} without the RPC."""
    import grpc
    from attnserve_bench.perf_analyzer import model_statistics

    try:
        stats = model_statistics(target, model, timeout_s)
    except grpc.RpcError as exc:
        print(f"batch_stats: no statistics from {target}: {exc.code().name}", file=sys.stderr)
        return {}
    except IndexError:  # an answer without the model's
        return {}
    return {
        "executions": {
            str(b.batch_size): {p: [getattr(b, p).count, getattr(b, p).ns] for p in PHASES} for b in stats.batch_stats
        }
    }


def diff(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, float]]:
    """Per batch size with executions in the window: executions, and µs a sequence in each phase."""
    rows = []
    old = before.get("executions", {})
    for size, phases in sorted(after.get("executions", {}).items(), key=lambda kv: int(kv[0])):
        was = old.get(size, {p: [0, 0] for p in PHASES})
        executions = phases["compute_infer"][0] - was["compute_infer"][0]
        if executions <= 0:
            continue
        sequences = executions * int(size)
        row = {"batch": int(size), "executions": executions}
        for p in PHASES:
            row[p] = (phases[p][1] - was[p][1]) / 1e3 / sequences
        rows.append(row)
    return rows


def table(rows: list[dict[str, float]], min_batches: int = 1) -> str:
    if not rows:  # `diff` keeps only sizes with executions in the window
        return "no batch ran in the window"
    lines = [
        "| batch (sequences) | executions | compute µs a sequence | staging µs | results µs |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    shown = [r for r in rows if r["executions"] >= min_batches]
    for r in shown:
        lines.append(
            f"| {r['batch']} | {r['executions']} | {r['compute_infer']:.0f} | {r['compute_input']:.1f} |"
            f" {r['compute_output']:.1f} |"
        )
    executions = sum(r["executions"] for r in rows)
    sequences = sum(r["executions"] * r["batch"] for r in rows)

    def mean(phase: str) -> float:
        return sum(r[phase] * r["executions"] * r["batch"] for r in rows) / sequences

    lines.append(
        f"| all: mean {sequences / executions:.1f} | {executions} | {mean('compute_infer'):.0f} |"
        f" {mean('compute_input'):.1f} | {mean('compute_output'):.1f} |"
    )
    if len(shown) < len(rows):
        lines.append(f"(batch sizes with fewer than {min_batches} executions are in the total only)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="print the server's batch statistics now, as JSON")
    snap.add_argument("target", help="HOST:PORT of the server's gRPC port")
    snap.add_argument("model")
    between = sub.add_parser("diff", help="a table of what each batch size cost between two snapshots")
    between.add_argument("before")
    between.add_argument("after")
    between.add_argument("--min-batches", type=int, default=1, help="a row only for sizes run this often")
    args = parser.parse_args(argv)
    if args.command == "snapshot":
        json.dump(snapshot(args.target, args.model), sys.stdout)
        print()
        return 0
    with open(args.before) as f, open(args.after) as g:
        before, after = json.load(f), json.load(g)
    if not before or not after:
        print("the server gave no batch statistics (no KServe v2 ModelStatistics)")
        return 0
    print(table(diff(before, after), args.min_batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
