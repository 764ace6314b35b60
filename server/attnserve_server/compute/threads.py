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

Batch time alone could not tell W1 at concurrency 32 from L=256 there: two threads measured 1.0-1.1x
and 1.14x faster, close enough that the noise of single batches decided. Fresh W1 servers ran a third
to a half of their batches on two threads in 6 of 8 runs, and served less (twenty-ninth pass).
What tells the two apart is how long the worker's thread waits (for a core, or for the GIL) while it
runs a batch on one thread: 21-31% of the batch at W1, where the event loop and gRPC want the other
core and a second thread would take it from them; 11-15% at L=256; ~5% at L=256 at concurrency 4. So
a batch of several runs on one thread while one thread's batches wait CONTENDED of their time or more,
unless every thread computes at least STRONG_SPEEDUP times faster (WL: ~1.9x), which pays for the
core wherever it comes from. Against the batch-time rule alone, eight fresh servers each in turn
served W1 at concurrency 32 at a median 1711 against 1651 req/s. Every thread's batches then remain
as probes, and a lone request between batches of several (about one batch in ten at concurrency 32)
was still timed on its own: each woke the partner, which then spun on the loop's core. So while
batches of several are short of cores, every thread is probed SHORT_PROBE_FACTOR times less often,
and a lone request within LONE_UNDER_LOAD of a batch of several runs on one thread. W1 at concurrency
32 then served as much as `--torch-threads 1` (1.017 in pairs, against 0.942 before). Those pairs ran
while perf_analyzer also asked for the attention weights; without them (thirty-sixth pass) the server
ran 99% of W1's batches at concurrency 32 on one thread, and `--torch-threads 1` served 1.046x the
default in pairs (6 of 8), within the pairs' noise of a few percent.

A lone request over ALONE_FLOOR_MACS is measured the same way, apart from batches of several: what
decides it is what a wake of the other core costs, and that differs by machine. W1 alone (19 M) ran
faster on one thread on the Intel VM of BENCHMARKS.md's later passes (under a short OpenMP spin)
and on two on its AMD VMs. It differs on one VM by the minute, too: the host moves the two vCPUs
between two cores of one L3 complex, two complexes and one core's two hyperthreads
(scripts/vcpu_placement.py), and W1 on two threads took ~355 µs, 440-650 and ~570, against ~530 on
one throughout (Zen 4, sixty-third pass). The lone arm follows such a move within ~50 requests. Only
a worker's thread measures: the event loop's solo runs take only requests that this rule runs on
one thread (model.py).

A lone request within LONE_UNDER_LOAD of a batch of several is not alone on the machine, though: the
loop is answering that batch and decoding the next. If its work is under `small_batch_macs` it runs
on one thread, as a batch of several that small would. Before, only cores measured short did that, and
a batch of several requests under `small_batch_macs` is never timed: W1 at concurrency 4 and 8 (batches
of 2-4, a fifth of them lone) ran its lone requests on whatever a spell at concurrency 1 had taught,
there two threads, whose second woke on the loop's core. In pairs after a window at concurrency 1
(BENCHMARKS.md, forty-seventh pass), W1 at 8 served 1.073x (p99 0.66x) and at 4 1.225x (p99 0.42x),
and the same within the noise at 1, 2, 4 and 8 without that window, at 32, and for L=128 and E=1024.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Below this many multiply-adds a lone request runs on one thread even with the machine to itself;
# above it, on whichever its thread measures faster (ThreadChooser). A second thread must be woken on
# the other core at each parallel region its short spin (openmp.py) does not bridge, and on the 2-vCPU
# VM of BENCHMARKS.md a wake there costs 35-90 µs (scripts/thread_wakes.py: a round trip of two wakes
# 66-178 µs, 13-24 on one CPU). At concurrency 1 one thread served W1 (19 M) with a 5-8% lower p50
# than two, L=96 (30 M) the same, L=128 (42 M) 10% slower (nineteenth pass); on the AMD VM of the
# sixth pass two threads were 8% faster at W1. Under this floor (L=32 at E=256 is 8.9 M) a second
# thread lost on both (five L=1 sequences, 1.3 M: 18 against 62 µs a sequence).
ALONE_FLOOR_MACS = 8_000_000
# A batch of several requests below this runs on one thread (the server's --small-batch-macs).
SMALL_BATCH_MACS = 128_000_000
# Every thread must compute a measured batch (of several requests, or a lone one over the floor) at
# least this much faster than one to be used for it (the server's --min-parallel-speedup). In-process
# two are 1.6-1.9x faster (W1 and L=256); under contention W1 measured 0.75-1.05x and L=256 1.16x. A
# little above 1: a tie goes to the cheaper choice.
MIN_SPEEDUP = 1.05
# Batches of several requests on one thread that wait for a core this share of their time or more
# (a mean over recent batches) run on one thread, unless every thread is STRONG_SPEEDUP times faster
# (the module docstring): between W1's 21-31% and L=256's 11-15% at concurrency 32 on the 2-vCPU VM.
CONTENDED = 0.2
STRONG_SPEEDUP = 1.5
# A lone request that comes within this many lone requests of a batch of several runs on one thread
# too if it has less work than `small_batch_macs`, or while such batches keep to one thread for want
# of a core: the server is under load, and a second thread would take the core from the event loop
# and spin there afterwards (openmp.py).
LONE_UNDER_LOAD = 8
# While batches of several keep to one thread for want of a core, every thread is probed this many
# times less often: each probe wakes the partner, which then spins on the core the loop wanted. W1 at
# concurrency 32 lost ~3% to probes every 32 batches (twenty-ninth pass); one thread's batches keep
# telling the wait, so easing load still shows at once.
SHORT_PROBE_FACTOR = 8
# One batch in PROBE_EVERY runs on the arm not in use, to keep its estimate current; each estimate is
# an exponentially weighted mean of seconds per multiply-add with this weight for the newest batch.
# Batches under load vary by a third or more (p10 to p90), and with a weight of 0.25 each mean wandered
# ~13%: W1 at concurrency 32, two threads 6% slower a request than one, ran 26-32% of its batches on
# two, most of them after a probe of one thread had come out slow. With 0.1, 2-5% (probes); a lasting
# change still moves the choice within ~8 batches (BENCHMARKS.md, twentieth pass).
PROBE_EVERY = 32
WEIGHT = 0.1
# A probe costs what the other arm takes beyond the chosen one, so probes come further apart than
# PROBE_EVERY when that arm is much slower: at most this share of the compute time goes to probing.
# WL (E=1024, L=256) computes ~1.9x as fast on two threads (in-process 9.0 against 17.3 ms a
# sequence); a one-thread probe every 32 of its ~200 ms batches put its slower batch in p99 (487-512
# against 386-424 ms with no probes; BENCHMARKS.md, twelfth pass). So there every ~90 batches, and
# still every 32 where the two are close (W1 under load).
PROBE_BUDGET = 0.01
# Each choice is tried this many times, in turn, before either is trusted, and its estimate starts
# from the median of those batches: with one sample each, WL once stayed on one thread for a whole 6 s
# run (51.7 against ~80 req/s; twelfth pass). A plain mean of three did it too: a first batch on two
# threads at 3-5x its usual cost (cold) put their mean above one thread's, and WL served ~52 req/s on
# one thread for the next 20-40 s (fifteenth pass). A median ignores one such batch.
FIRST_SAMPLES = 3
# After those, a batch moves its choice's mean as if it took at most this factor more (or less) than
# the mean. Two WL batches on two threads at 3x their usual time (a noisy neighbour) otherwise lifted
# their mean over one thread's, and the worker then ran ~30% slower on one thread until probes brought
# it back, 32 batches (10 s) each (fifteenth pass). A lasting change still shows within a few batches.
SPIKE = 1.5


@dataclass(frozen=True)
class CpuThreads:
    """A CPU worker's intra-op threads: `count` at most (None: torch's default, one per core), one for
    small batches (small_batch_macs 0: every batch on `count`), and for larger batches, and lone
    requests over ALONE_FLOOR_MACS, whichever measures better (min_speedup 0: every thread, not
    measured)."""

    count: int | None = None
    small_batch_macs: int = SMALL_BATCH_MACS
    min_speedup: float = MIN_SPEEDUP

    def for_batch(self, most: int, macs: int, requests: int) -> int:
        """Threads for a batch of `requests` requests and `macs` multiply-adds, of `most` available,
        by size alone (a measured batch is one this gives `most`)."""
        if most <= 1 or self.small_batch_macs <= 0:
            return most
        if macs < min(ALONE_FLOOR_MACS, self.small_batch_macs) or (requests > 1 and macs < self.small_batch_macs):
            return 1
        return most

    def chooser(self, most: int) -> ThreadChooser:
        """The per-thread chooser of a worker thread that may use `most` threads."""
        return ThreadChooser(self, most)


class _Arms:
    """What a chooser knows of one kind of batch (a lone request, or several) on each choice."""

    def __init__(self, most: int) -> None:
        self.cost: dict[int, float] = {}  # threads -> mean seconds per multiply-add
        self.first: dict[int, list[float]] = {most: [], 1: []}  # threads -> costs of its first batches
        self.since_probe = 0  # measured batches since the other choice last ran
        self.waited: float | None = None  # mean share of a one-thread batch spent waiting for a core


class ThreadChooser:
    """Chooses a batch's intra-op threads on one worker thread, learning from the batches it times.

    A batch that the size rule gives every thread ("measured") runs on one thread or on all. A lone
    request and a batch of several are learned apart (the second thread's cost differs: a lone
    request's is a wake of the other core). For each kind, each choice keeps a mean of seconds per
    multiply-add over its recent batches; all threads are used while their mean is at least
    `min_speedup` times lower than one thread's. Every PROBE_EVERY-th measured batch runs on the other
    choice, so a change in load (the loop getting busier, other work on the host) shows within a few
    hundred batches; where the other choice is much slower, less often (PROBE_BUDGET). At first the two
    are tried in turn, FIRST_SAMPLES times each, and each mean starts from the median of those; later
    batches move it by at most a SPIKE factor each. Not thread-safe: one per worker thread.
    """

    def __init__(self, rule: CpuThreads, most: int, probe_every: int = PROBE_EVERY, weight: float = WEIGHT) -> None:
        self._rule = rule
        self.most = most
        self._probe_every = probe_every
        self._weight = weight
        self._measure = most > 1 and rule.small_batch_macs > 0 and rule.min_speedup > 0
        self._arms = {True: _Arms(most), False: _Arms(most)}  # alone? -> what is known
        self._lone_run = LONE_UNDER_LOAD  # lone requests since the last batch of several, up to LONE_UNDER_LOAD

    def pick(self, macs: int, requests: int) -> tuple[int, bool]:
        """(threads, measured): the threads for this batch, and whether `record` should learn from it."""
        threads = self._rule.for_batch(self.most, macs, requests)
        alone = requests <= 1
        if not alone:
            self._lone_run = 0
        elif self._lone_run < LONE_UNDER_LOAD:
            self._lone_run += 1
        if not self._measure or threads != self.most:
            return threads, False
        under_load = alone and self._lone_run < LONE_UNDER_LOAD
        if under_load and (macs < self._rule.small_batch_macs or self._short_of_cores(self._arms[False])):
            return 1, False
        arms = self._arms[alone]
        fewer = min((self.most, 1), key=lambda t: len(arms.first[t]))  # a tie: every thread first
        if len(arms.first[fewer]) < FIRST_SAMPLES:
            return fewer, True
        best = self.preferred(alone)
        other = 1 if best == self.most else self.most
        arms.since_probe += 1
        if arms.since_probe >= self.probe_interval(best, other, alone):
            arms.since_probe = 0
            return other, True
        return best, True

    def probe_interval(self, best: int, other: int, alone: bool = False) -> int:
        """Measured batches from one probe of `other` to the next: PROBE_EVERY (SHORT_PROBE_FACTOR times
        that while batches of several are short of cores), or more where `other` is so much slower that
        probing it as often would cost more than PROBE_BUDGET."""
        arms = self._arms[alone]
        excess = arms.cost[other] / arms.cost[best] - 1.0
        every = self._probe_every * (SHORT_PROBE_FACTOR if not alone and self._short_of_cores(arms) else 1)
        return max(every, math.ceil(excess / PROBE_BUDGET))

    def preferred(self, alone: bool = False) -> int:
        """The threads a measured batch (of several requests, or `alone`) runs on between probes: all,
        unless they are not yet known to be at least min_speedup faster, or (several requests) one
        thread's batches wait for a core and all are not STRONG_SPEEDUP faster."""
        arms = self._arms[alone]
        one, every = arms.cost.get(1), arms.cost.get(self.most)
        if one is None or every is None:
            return self.most
        if self._short_of_cores(arms):
            return 1
        return self.most if one >= self._rule.min_speedup * every else 1

    def _short_of_cores(self, arms: _Arms) -> bool:
        """Whether one thread's batches (of several) wait for a core CONTENDED of their time, and every
        thread is not STRONG_SPEEDUP faster."""
        one, every = arms.cost.get(1), arms.cost.get(self.most)
        if arms.waited is None or one is None or every is None:
            return False
        return arms.waited >= CONTENDED and one < STRONG_SPEEDUP * every

    def record(self, threads: int, macs: int, seconds: float, requests: int, on_cpu: float | None = None) -> None:
        """A measured batch of `requests` requests and `macs` multiply-adds took `seconds` to compute
        on `threads` threads; `on_cpu`, where known: the share of that time its thread ran on a CPU."""
        if macs <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        arms = self._arms[requests <= 1]
        if threads == 1 and requests > 1 and on_cpu is not None:
            waited = min(max(1.0 - on_cpu, 0.0), 1.0)
            arms.waited = waited if arms.waited is None else arms.waited + self._weight * (waited - arms.waited)
        cost = seconds / macs
        first = arms.first[threads]
        if len(first) < FIRST_SAMPLES:
            # The median of the first few batches (one slow first batch does not count), then a moving mean.
            first.append(cost)
            arms.cost[threads] = statistics.median(first)
            return
        previous = arms.cost[threads]
        cost = min(max(cost, previous / SPIKE), previous * SPIKE)
        arms.cost[threads] = previous + self._weight * (cost - previous)
