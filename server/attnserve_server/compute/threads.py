"""How many intra-op threads a CPU batch runs on.

Two threads halve a large batch's time for about the same CPU, but a small batch pays for them: its
parallel regions are short, so the second thread mostly wakes, waits at barriers and sleeps again.
On the idle box (E=256, 8 heads, one worker thread, libgomp's short spin, µs per sequence, wall /
CPU; BENCHMARKS.md, sixth pass):

| batch | one thread | two threads |
| --- | --- | --- |
| 5 sequences of L=1 (1.3 M multiply-adds) | 18 / 23 | 62 / 69 |
| 1 sequence of L=64 (19 M) | 422 / 453 | 388 / 783 |
| 8 sequences of L=16 (35 M) | 89 / 93 | 73 / 138 |
| 12 sequences of L=64 (226 M) | 425 / 431 | 249 / 471 |

Under load the event loop needs the second core, and CPU per request is what decides throughput. So a
batch of several requests (others are arriving: the loop is busy) with less work than
`small_batch_macs` runs on one thread, as does any batch too small to gain from two even alone; the
rest run on every thread configured. Through perf_analyzer at concurrency 8 and 32 this served L=16
25-35% more requests per second and L=1 10-20% more, and left W1 as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

# Below this many multiply-adds one thread is faster even with the machine to itself (L=1: 607 ->
# 561 µs p50 at concurrency 1); a single W1 sequence (19 M) is faster on two.
ALONE_FLOOR_MACS = 10_000_000
# A batch of several requests below this runs on one thread (the server's --small-batch-macs).
SMALL_BATCH_MACS = 128_000_000


@dataclass(frozen=True)
class CpuThreads:
    """A CPU worker's intra-op threads: `count` at most (None: torch's default, one per core), one for
    small batches (small_batch_macs 0: every batch on `count`)."""

    count: int | None = None
    small_batch_macs: int = SMALL_BATCH_MACS

    def for_batch(self, most: int, macs: int, requests: int) -> int:
        """Threads for a batch of `requests` requests and `macs` multiply-adds, of `most` available."""
        if most <= 1 or self.small_batch_macs <= 0:
            return most
        if macs < min(ALONE_FLOOR_MACS, self.small_batch_macs) or (requests > 1 and macs < self.small_batch_macs):
            return 1
        return most
