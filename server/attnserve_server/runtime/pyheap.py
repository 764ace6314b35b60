"""Python's garbage collector in a long-running server: the startup heap frozen, young collections rarer.

A serving process holds ~180,000 objects the collector tracks (torch, gRPC, protobuf, numpy) and
never frees, and its requests make many short-lived ones. With CPython's defaults a full collection
walks all of them: ~90 ms with the GIL held, in which neither the event loop nor a worker's Python
runs, and under load it came every few seconds (8 in a ~30 s run, 733 ms in all; BENCHMARKS.md
has the counts and what freezing did to p99).
Frozen (`gc.freeze`), the startup objects are left out of every later collection. A larger first
threshold lets most of a request's objects die by reference counting before a collection looks at
them: young collections took 91 ms in all instead of 303 over the same load.
"""

from __future__ import annotations

import gc

# Allocations (less deallocations) of tracked objects between young collections; CPython's is 700.
YOUNG_THRESHOLD = 5000


def settle() -> str:
    """Call once the process has loaded everything it keeps (models warm, servers started): collects
    what startup left, freezes the rest out of later collections, raises the young threshold.
    Returns what it did, for the log."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
    return f"{gc.get_freeze_count()} startup objects frozen, young threshold {YOUNG_THRESHOLD}"
