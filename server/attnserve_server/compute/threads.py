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
`small_batch_macs` runs on one thread, as does any batch too small to gain from two even alone.
Through perf_analyzer at concurrency 8 and 32 this served L=16 25-35% more requests per second and
L=1 10-20% more, and left W1 as it was.

A larger batch of several requests is decided by measurement (`ThreadChooser`). Its size cannot say
whether the other threads will find free cores. Under load on the same VM, two threads computed W1 at
concurrency 32 no faster than one (wall µs per request 565-612 against 556-580; BENCHMARKS.md,
eleventh pass): whenever the loop preempts one of them, the other waits at the next barrier. One
thread then leaves the loop its core, costs 5-10% less CPU per request and served 5-9% more. L=256
at concurrency 32, whose loop is far less busy, still ran 1.16x faster on two, and lost 15% on one.
So each worker thread times such batches on both and runs them on every thread only while that
measures at least `min_speedup` times faster than one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Below this many multiply-adds one thread is faster even with the machine to itself (L=1: 607 ->
# 561 µs p50 at concurrency 1); a single W1 sequence (19 M) is faster on two.
ALONE_FLOOR_MACS = 10_000_000
# A batch of several requests below this runs on one thread (the server's --small-batch-macs).
SMALL_BATCH_MACS = 128_000_000
# Every thread must compute a batch of several requests at least this much faster than one to be used
# for it (the server's --min-parallel-speedup). In-process two are 1.6-1.9x faster (W1 and L=256); under
# contention W1 measured 0.75-1.05x and L=256 1.16x. A little above 1: a tie goes to the cheaper choice.
MIN_SPEEDUP = 1.05
# One batch in PROBE_EVERY runs on the arm not in use, to keep its estimate current; each estimate is
# an exponentially weighted mean of seconds per multiply-add with this weight for the newest batch.
PROBE_EVERY = 32
WEIGHT = 0.25


@dataclass(frozen=True)
class CpuThreads:
    """A CPU worker's intra-op threads: `count` at most (None: torch's default, one per core), one for
    small batches (small_batch_macs 0: every batch on `count`), and for larger batches of several
    requests whichever measures better (min_speedup 0: every thread, not measured)."""

    count: int | None = None
    small_batch_macs: int = SMALL_BATCH_MACS
    min_speedup: float = MIN_SPEEDUP

    def for_batch(self, most: int, macs: int, requests: int) -> int:
        """Threads for a batch of `requests` requests and `macs` multiply-adds, of `most` available,
        by size alone (a measured batch is one this gives `most` with several requests)."""
        if most <= 1 or self.small_batch_macs <= 0:
            return most
        if macs < min(ALONE_FLOOR_MACS, self.small_batch_macs) or (requests > 1 and macs < self.small_batch_macs):
            return 1
        return most

    def chooser(self, most: int) -> ThreadChooser:
        """The per-thread chooser of a worker thread that may use `most` threads."""
        return ThreadChooser(self, most)


class ThreadChooser:
    """Chooses a batch's intra-op threads on one worker thread, learning from the batches it times.

    A batch of several requests that the size rule gives every thread ("measured") runs on one thread
    or on all. Each choice keeps a mean of seconds per multiply-add over its recent batches; all
    threads are used while their mean is at least `min_speedup` times lower than one thread's. Every
    PROBE_EVERY-th measured batch runs on the other choice, so a change in load (the loop getting
    busier, other work on the host) shows within a few hundred batches. A choice with no estimate yet
    is tried first. Not thread-safe: one per worker thread.
    """

    def __init__(self, rule: CpuThreads, most: int, probe_every: int = PROBE_EVERY, weight: float = WEIGHT) -> None:
        self._rule = rule
        self.most = most
        self._probe_every = probe_every
        self._weight = weight
        self._measure = most > 1 and rule.small_batch_macs > 0 and rule.min_speedup > 0
        self._cost: dict[int, float] = {}  # threads -> mean seconds per multiply-add
        self._measured = 0  # measured batches so far

    def pick(self, macs: int, requests: int) -> tuple[int, bool]:
        """(threads, measured): the threads for this batch, and whether `record` should learn from it."""
        threads = self._rule.for_batch(self.most, macs, requests)
        if not self._measure or requests <= 1 or threads != self.most:
            return threads, False
        self._measured += 1
        for arm in (self.most, 1):
            if arm not in self._cost:
                return arm, True
        best = self.preferred()
        if self._measured % self._probe_every == 0:
            return (1 if best == self.most else self.most), True
        return best, True

    def preferred(self) -> int:
        """The threads a measured batch runs on between probes: all, unless they are not yet known to be
        at least min_speedup faster."""
        one, every = self._cost.get(1), self._cost.get(self.most)
        if one is None or every is None:
            return self.most
        return self.most if one >= self._rule.min_speedup * every else 1

    def record(self, threads: int, macs: int, seconds: float) -> None:
        """A measured batch of `macs` multiply-adds took `seconds` to compute on `threads` threads."""
        if macs <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        cost = seconds / macs
        previous = self._cost.get(threads)
        self._cost[threads] = cost if previous is None else previous + self._weight * (cost - previous)
