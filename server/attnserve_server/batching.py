"""Admission and dynamic batching: a bounded queue per model from which its runners pull batches.

Knows neither protobuf nor devices. Callers submit on the event loop; each runner (a device
worker's thread) takes its next batch from the queue itself, the moment it is free, as Triton's
scheduler threads do. Under load the loop is busy decoding and answering, and a worker that waited
for the loop to hand it its next batch idled ~2 ms of every ~7.6 ms batch (BENCHMARKS.md).

A batch starts with the oldest waiting request, takes the requests behind it that run the same
computation (same group), and closes when it reaches max_batch_size sequences or max_batch_tokens
padded tokens, or max_queue_delay after its first request arrived. While every runner is busy,
requests simply queue, so batches grow with load.

Pipelining (`BatchLimits.pipeline`): a batch takes at most half of the requests in play, counted as
those the previous batch answered (the loop is sending them, and their clients will send again)
plus those waiting. A worker that took everything made clients move in waves: eight W1 clients'
requests computed as one batch, were answered together, came back one by one, and the free worker
took the first alone. With the cap they settle into two groups in turn: the loop answers one while
the worker computes the other. On the 2-core VM, in alternating pairs, W1 served 25-35% more at
concurrency 4 and 8 and the same at 1; at 32 the pairs gained 9-26%, which one side-by-side run did
not confirm (BENCHMARKS.md, eleventh pass). A model with a max_queue_delay asked for full batches:
it gets no cap.

With pipelining a batch of several may also close once it holds `pipeline_work` (multiply-adds, on
the CPU) and at least PIPELINE_MIN_SEQUENCES sequences: past a few hundred million multiply-adds a
larger CPU batch computes no faster per request, and the two groups only grow coarser. L=256 at
concurrency 32 took batches of ~16 requests (1.6 G multiply-adds); with a bound of 400 M (4 a batch)
it served 1.12x more in pairs, and W1 the same, but WL 0.93-0.98x, so it is off by default
(BENCHMARKS.md, thirty-first pass).

Lingering (`BatchLimits.linger_work`, `max_linger_s`): a free runner takes what is queued at once,
which under load is the right call for requests whose compute dwarfs a batch's fixed cost (W1), and
the wrong one for small requests. When the event loop is the bottleneck (L=16 at concurrency 64 on
the 2-vCPU VM), a runner that takes each request or two as they trickle in spends a batch's fixed
cost (dispatch, staging, two thread wakes) on each, and takes that CPU from the loop: batches of 1.5
served 0.80x the 60-line batcher, whose 1 ms window gathers more. So a runner lingers, but only when
requests arrived while it computed its last batch (clients are ahead of it; a lone client's next
request cannot arrive before its answer, so concurrency 1 never waits), and only for a batch with
less work than `linger_work`: it then waits up to `max_linger_s` after the batch's first request for
more, without the pipelining cap, which would otherwise hold such batches at one or two requests.
L=16 at concurrency 64 served 18% more while the host was fast and about the same while it was slow,
when slower batches gather more requests anyway (BENCHMARKS.md, twenty-third pass).

A lingering batch stops waiting once every request its clients keep in play is in: queued or computing.
The batcher counts the most it has seen in at once lately (sampled at each admission, the maximum over
the current and the previous window of `IN_PLAY_WINDOW_S`); when that many are in, no client can send
another before an answer goes out, and waiting longer would only add latency. At concurrency 4 a batch
then closes as soon as the requests whose answers just went out are back; at 32, where most of the
requests in play are in gRPC's hands, it waits up to `max_linger_s`. With that rule a longer bound pays:
small requests (E=64, 4 heads, L=16) served 1.05-1.23x as much at concurrency 8 to 128 with 3 ms as with
1 ms without it, in pairs, and 0.98x at 2 and 4, where a 3 ms bound alone lost 13-39% (BENCHMARKS.md,
forty-fifth pass). While load grows, each new most-in-at-once looks like "all in", and the batch closes
early, as it would without lingering. When load falls, the clients that left are forgotten within two
windows: at E=64 L=16, after 32 clients became 4, batches lingered their whole 3 ms (p50 ~3.4 ms against
2.1-2.3) for about 1.5 s while an estimate that shrank by 0.1% an admission forgot them (BENCHMARKS.md,
forty-sixth pass), and the slower the requests, the longer that took.

Pairing (`BatchLimits.pair_work`; a runner that passes `shared`, and a `second` runner): a CPU batch
on several intra-op threads meets at a barrier after every parallel loop, and a thread that the event
loop, gRPC or a client preempts leaves the others waiting there. Two batches side by side on a share
of the threads each wait for nobody. So a batch of at least twice `pair_work`, taken while no other
computes, splits in two of about equal work: the first runner computes the first half and the second
runner the rest, each `shared` (the rest stays queued: a first runner that ends its half before the
second wakes takes it itself). While a shared batch computes, a runner that frees takes what is queued
as shared too, so under load the two stay paired; a first runner that frees while the second idles
takes its next batch whole (on every thread), or splits it again. A second runner takes only shared
batches, and only while one computes: a whole batch has every thread. On the 2-vCPU VM (BENCHMARKS.md,
thirty-seventh pass) pairing served WL at concurrency 4 to 32 3-8% more in pairs, and L=256 and L=512 at
16 to 32 and E=1024 L=64 at 32 11-16% more; batches of less work than W1's at concurrency 32 do not split.

On a quiet server a lone request may instead run on the event loop itself, skipping the two thread
hops (`allow_solo`; solo.py says when).

A batch of several that fails on its runner runs again one request at a time on the same runner, so
that a request that cannot compute (or a batch too large for the device's memory) fails alone: only
the requests that fail by themselves are answered with the failure, and the others are answered. A
runner that raises WorkerLost (its device can compute no more) or dies stops the batcher: what it
holds is answered UNAVAILABLE, and `on_broken` tells the server, which stops and exits non-zero.

Threads: one lock guards the queue, and idle runners wait on its condition (a second runner on one
of its own, so that a notify meant for a runner that may take the batch never wakes one that may
not). A runner that waits for more (lingering, or a delay) is woken only by an arrival that may close
its batch (`_Gathering`). Everything the batcher tells the rest of the server (observer reports, queue listeners,
answers) happens on the event loop: a runner posts one callback per batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from attnserve_server.errors import (
    BatcherStopped,
    BatchFailed,
    DeadlineExpired,
    QueueFull,
    ServingError,
    ShuttingDown,
    WorkerLost,
)
from attnserve_server.solo import SoloPolicy

T = TypeVar("T")
R = TypeVar("R")
# A runner computes one batch, blocking its own thread: results in the items' order.
Runner = Callable[[list[T]], list[R]]
# Told of every batch a runner finished (its items, and its results or its error), on the event loop.
BatchDone = Callable[[list[T], "list[R] | None", "BaseException | None"], None]
log = logging.getLogger(__name__)
# An idle runner looks this often whether its event loop is gone (a server that died without closing
# its batcher), so a runner's thread never outlives it: exiting Python joins executor threads.
IDLE_CHECK_S = 0.5
# The requests in play (module docstring: lingering) are the most seen at once in the current window of
# this length and the one before it: clients that left are forgotten within two windows, however slowly
# the rest send. Each window holds hundreds of admissions of requests small enough to linger.
IN_PLAY_WINDOW_S = 0.25


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int  # sequences
    max_batch_tokens: int  # sequences x longest query length
    max_queue_delay_s: float
    max_queue_size: int  # requests waiting
    max_queue_bytes: int = 1 << 62  # bytes of the requests waiting
    max_batch_memory_bytes: int = 1 << 62  # the sum of a batch's items' memory estimates
    # A batch takes at most half the requests in play (module docstring). Off here, the mechanism's
    # default; a served model's settings turn it on unless configured otherwise.
    pipeline: bool = False
    # Lingering (module docstring): a batch of less work than `linger_work` (the items' `work` units,
    # multiply-adds for a served model) waits up to `max_linger_s` after its first request for more,
    # while requests keep arriving as batches compute. 0 (either): never.
    linger_work: int = 0
    max_linger_s: float = 0.0
    # With `pipeline`, a batch of several closes once it holds this much work (the items' `work`) and at
    # least PIPELINE_MIN_SEQUENCES sequences (module docstring). 0: no such bound.
    pipeline_work: int = 0
    # Pairing (module docstring): a batch of at least twice this much work, taken while no other batch
    # computes, splits into two halves that compute side by side on a share of the threads each. 0: never.
    pair_work: int = 0


# A call the caller cancels this close to its deadline is counted as expired, not cancelled: the
# caller's deadline is ours less the time its request took to arrive, and a client gives up at its
# own (its cancellation then reaches us a moment before our deadline).
DEADLINE_SLACK_S = 0.01
# The fewest sequences a batch holds before `pipeline_work` may close it: WL (1.2 G multiply-adds a
# request) served 0.78x with one request a batch, and computes ~12% slower a request alone than in
# batches of 2-8 (BENCHMARKS.md, thirty-first pass).
PIPELINE_MIN_SEQUENCES = 4


def refusal(limits: BatchLimits, depth: int, queued_bytes: int, closing: bool) -> tuple[str, ServingError] | None:
    """Why a new item would be refused with this queue (the drop reason and the error), or None."""
    if closing:
        return "shutting_down", ShuttingDown("the server is shutting down and takes no new requests")
    if depth >= limits.max_queue_size:
        return "queue_full", QueueFull(
            f"the model's queue is full ({limits.max_queue_size} requests waiting); retry later"
        )
    if queued_bytes >= limits.max_queue_bytes:
        return "queue_full", QueueFull(
            f"the model's queue is full ({queued_bytes} bytes of requests waiting, max_queue_bytes "
            f"{limits.max_queue_bytes}); retry later"
        )
    return None


class BatchObserver(Protocol):
    """What the batcher reports (metrics implement it), always on the event loop."""

    def queue_depth(self, depth: int) -> None: ...

    def dropped(self, reason: str) -> None: ...

    def batch_started(self, requests: int, queue_waits_s: list[float]) -> None: ...


class _NoObserver:
    def queue_depth(self, depth: int) -> None:
        pass

    def dropped(self, reason: str) -> None:
        pass

    def batch_started(self, requests: int, queue_waits_s: list[float]) -> None:
        pass


@dataclass(eq=False)
class _Entry(Generic[T]):
    item: T
    sequences: int
    length: int
    nbytes: int
    memory: int
    work: int
    group: Hashable
    enqueued: float  # time.monotonic()
    expires: float  # time.monotonic(); inf without a deadline
    future: asyncio.Future = field(repr=False)
    queued: bool = True  # under the lock


@dataclass(eq=False)
class _Batch(Generic[T]):
    entries: list[_Entry[T]]
    waits_s: list[float]  # each entry's time in the queue
    shared: bool = False  # computes on a share of the worker's threads, beside another batch (pairing)
    items: list[T] = field(init=False)
    taken: float = field(init=False)  # time.monotonic() when it was taken to compute

    def __post_init__(self) -> None:
        self.items = [e.item for e in self.entries]
        self.taken = time.monotonic()


@dataclass(eq=False)
class _Gathering:
    """A runner's timed wait for more of one group (lingering, or a max_queue_delay): the group's totals
    as its plan last saw them, so that `submit` wakes it only for an arrival after which the batch may
    close. Waking it at every arrival, to plan again and go back to waiting, cost ~2 thread wakes a
    request, each taking the GIL from the event loop (BENCHMARKS.md, forty-fifth pass)."""

    group: Hashable
    sequences: int
    longest: int
    memory: int
    work: int
    closes_at_work: int  # lingering: the work at which the batch closes; 0: only a full batch closes it

    @classmethod
    def of(cls, group: Hashable, queue: deque[_Entry], closes_at_work: int) -> _Gathering:
        return cls(
            group,
            sum(e.sequences for e in queue),
            max((e.length for e in queue), default=0),
            sum(e.memory for e in queue),
            sum(e.work for e in queue),
            closes_at_work,
        )

    def closes(self, entry: _Entry, limits: BatchLimits) -> bool:
        """Counts a new `entry` in: True if the batch may now close, full or with enough work (whenever
        `Batcher._plan` would call it full, and a little more often: a spurious wake costs a plan, a
        missed one a late batch)."""
        if entry.group != self.group:
            return False  # a runner plans the oldest request's group only: this one waits its turn
        self.sequences += entry.sequences
        self.longest = max(self.longest, entry.length)
        self.memory += entry.memory
        self.work += entry.work
        return (
            self.sequences >= limits.max_batch_size
            or self.sequences * self.longest >= limits.max_batch_tokens
            or self.memory > limits.max_batch_memory_bytes
            or 0 < self.closes_at_work <= self.work
        )


@dataclass(frozen=True)
class _Alone:
    """A request of a failed batch that failed again when it ran alone."""

    error: Exception


def _run_alone(runner: Runner, item: T) -> object:
    """One request of a failed batch, run again alone on the batch's runner: its result, or _Alone."""
    try:
        (result,) = runner([item])
    except WorkerLost:
        raise  # the runner's end: the whole batch is answered with it
    except Exception as exc:
        return _Alone(exc)
    return result


@dataclass(frozen=True)
class _Solo(Generic[T, R]):
    run: Runner
    done: BatchDone | None
    eligible: Callable[[T], bool]
    policy: SoloPolicy


class Batcher(Generic[T, R]):
    """Admits items, lets its runners pull batches of them, answers every caller.

    `submit`, `check_admission`, `watch`, `drain` and `close` are called on the event loop; `serve`
    on each runner's own thread, for as long as the batcher runs.
    """

    def __init__(self, limits: BatchLimits, observer: BatchObserver | None = None) -> None:
        self._limits = limits
        self._observer = observer or _NoObserver()
        self._loop: asyncio.AbstractEventLoop | None = None
        lock = threading.Lock()  # never taken twice by one thread
        self._cond = threading.Condition(lock)  # where idle runners wait
        self._second_cond = threading.Condition(lock)  # where an idle second runner waits (pairing)
        # Under the lock: the queue, and the batches taken and not yet answered.
        self._groups: dict[Hashable, deque[_Entry[T]]] = {}
        self._depth = 0
        self._queued_bytes = 0
        self._last_taken = 0  # requests in the batch taken last (pipelining counts them as in play)
        self._admitted = 0  # items ever queued: a runner counts those that arrived while it computed
        self._in_flight: set[_Batch[T]] = set()
        self._sharing = 0  # shared batches computing now (pairing)
        self._computing = 0  # requests in batches that runners took and have not finished
        # Lingering: the most requests queued or computing at once in this window and in the one before.
        self._in_play_now = self._in_play_before = 0
        self._window_ends = 0.0  # time.monotonic()
        self._gathering: _Gathering | None = None  # a first runner's timed wait for more; None: wake it at any arrival
        self._seconds = 0  # second runners serving (pairing)
        self._closing = False  # draining: no new items, and queued ones run without their delay
        self._stopped = False  # closed: runners return
        self._broken: ServingError | None = None
        # On the loop:
        self._changed = asyncio.Event()  # set whenever the queue or the batches in flight shrink
        self._listeners: list[Callable[[int, int, bool], None]] = []
        self._solo: _Solo[T, R] | None = None
        self._on_quiet: Callable[[], None] | None = None  # watch_quiet
        self._on_broken: Callable[[BaseException], None] | None = None  # on_broken
        self._on_busy: Callable[[], None] | None = None
        self._quiet_streak = 0
        self._quiet_in_a_row = 0  # admissions in a row that found the batcher quiet

    @property
    def depth(self) -> int:
        return self._depth

    def oldest_in_flight_s(self) -> float:
        """How long the batch computing longest has been at it (0 if none): for the watchdog (any thread)."""
        with self._cond:
            oldest = min((b.taken for b in self._in_flight), default=None)
        return 0.0 if oldest is None else time.monotonic() - oldest

    def start(self) -> None:
        """Binds the batcher to the running loop, where its callers' answers are delivered."""
        self._loop = asyncio.get_running_loop()

    def on_broken(self, listener: Callable[[BaseException], None]) -> None:
        """`listener(exc)` hears on the loop that the batcher stopped for good (a runner lost or dead)."""
        self._on_broken = listener

    def allow_solo(
        self,
        run: Runner,
        done: BatchDone | None,
        eligible: Callable[[T], bool],
        policy: SoloPolicy | None = None,
    ) -> None:
        """Lets a lone `eligible` item run as a batch of one on the event loop, by `run`, while
        `policy` says the server is quiet. Only for a single runner whose `run` may be called from
        the loop's thread while that runner is idle: nothing else computes while the loop does."""
        self._solo = _Solo(run, done, eligible, policy or SoloPolicy())

    def watch_quiet(self, listener: Callable[[], None], streak: int, on_busy: Callable[[], None] | None = None) -> None:
        """Calls `listener()` (on the loop) at each admission once `streak` admissions in a row, this
        one included, have found the batcher quiet (nothing queued or computing), and `on_busy()` at
        the first admission that finds it busy after such a streak."""
        self._on_quiet, self._quiet_streak, self._on_busy = listener, streak, on_busy

    # -- admission (on the loop) -----------------------------------------------------------

    async def submit(
        self,
        item: T,
        *,
        sequences: int,
        length: int,
        group: Hashable,
        deadline: float | None = None,
        expire: bool = True,
        nbytes: int = 0,
        memory: int = 0,
        work: int = 0,
    ) -> R:
        """Queues one item and waits for a runner's result for it. `deadline` is on the loop's clock.

        An item whose deadline has passed when a runner reaches it is dropped, not computed. With
        `expire`, a timer also fails it at its deadline while it waits. Without, the caller enforces
        the deadline itself (an RPC deadline cancels the call), which spares a timer per request.
        """
        loop = self._loop or asyncio.get_running_loop()  # (get_running_loop costs a getpid() in 3.11)
        now = time.monotonic()
        expires = math.inf if deadline is None else now + (deadline - loop.time())
        entry = _Entry(item, sequences, length, nbytes, memory, work, group, now, expires, loop.create_future())
        solo, on_quiet = self._solo, self._on_quiet
        quiet = (solo is not None or on_quiet is not None) and self._quiet()
        if on_quiet is not None:
            if quiet:
                self._quiet_in_a_row += 1
                if self._quiet_in_a_row >= self._quiet_streak:
                    on_quiet()
            else:
                if self._quiet_in_a_row >= self._quiet_streak and self._on_busy is not None:
                    self._on_busy()
                self._quiet_in_a_row = 0
        if solo is not None and solo.policy.admit(quiet) and solo.eligible(item) and expires > now:
            return self._run_solo(solo, entry)
        with self._cond:
            refused = self._refusal(nbytes)
            if refused is None:
                self._groups.setdefault(group, deque()).append(entry)
                self._queued_bytes += nbytes
                self._depth += 1
                self._admitted += 1
                self._count_in_play(now)
                gathering = self._gathering
                if gathering is None or gathering.closes(entry, self._limits) or self._all_in():
                    self._cond.notify()
                if self._sharing:
                    self._second_cond.notify()
        if refused is not None:
            self._refuse(*refused)
        self._report_depth()
        timer = loop.call_at(deadline, self._expire, entry) if expire and deadline is not None else None
        try:
            return await entry.future
        except asyncio.CancelledError:
            # The caller went away (cancelled, or its deadline passed): drop it before compute.
            if self._withdraw(entry):
                expired = deadline is not None and loop.time() >= deadline - DEADLINE_SLACK_S
                self._observer.dropped("deadline_exceeded" if expired else "cancelled")
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _quiet(self) -> bool:
        """Nothing queued, no batch computing, and nothing that refuses new items."""
        with self._cond:
            return not (self._depth or self._in_flight or self._closing or self._broken)

    def _run_solo(self, solo: _Solo[T, R], entry: _Entry[T]) -> R:
        """Runs one quiet entry as a batch of one on the loop's thread; answers as a runner would."""
        entry.queued = False
        batch = _Batch([entry], [0.0])
        with self._cond:
            self._in_flight.add(batch)
        results: list[R] | None = None
        error: BaseException | None = None
        try:
            results = solo.run(batch.items)
        except Exception as exc:  # the batch's failure: its caller is told, the server serves on
            error = exc
        solo.policy.ran()
        self._batch_done(batch, results, error, solo.done)
        return entry.future.result()

    def _refusal(self, nbytes: int) -> tuple[str, ServingError] | None:
        """Why an item of `nbytes` would be refused now: the drop reason ("" for a stopped batcher: not
        a drop) and the error, or None. Exact under the lock; a hint without it."""
        if self._broken is not None:
            return "", self._broken
        refused = refusal(self._limits, self._depth, self._queued_bytes, self._closing)
        if refused is None and self._queued_bytes + nbytes > self._limits.max_queue_bytes:
            refused = (
                "queue_full",
                QueueFull(
                    f"the model's queue holds {self._queued_bytes} bytes of requests; this one's {nbytes} would pass "
                    f"max_queue_bytes {self._limits.max_queue_bytes}; retry later"
                ),
            )
        return refused

    def check_admission(self) -> None:
        """Raises what `submit` would refuse an item with right now (full queue, shutdown), counting
        the drop: the edge asks before it decodes a request, so shedding at overload costs microseconds."""
        refused = self._refusal(0)
        if refused is not None:
            self._refuse(*refused)

    def _refuse(self, reason: str, error: ServingError) -> None:
        if reason:
            self._observer.dropped(reason)
        raise error

    def watch(self, listener: Callable[[int, int, bool], None]) -> None:
        """Calls `listener(depth, queued bytes, closing)` now and after every change the loop sees: an
        engine publishes them to its edge processes, which then refuse as `check_admission` would.
        A batch a runner takes is seen when it is answered (or at the next arrival, if sooner)."""
        self._listeners.append(listener)
        self._report_depth()

    def _report_depth(self) -> None:
        try:
            self._observer.queue_depth(self._depth)
            for listener in self._listeners:
                listener(self._depth, self._queued_bytes, self._closing)
        except Exception:  # a report is not worth a request: log it, serve on
            log.exception("reporting the queue's depth failed")

    def _withdraw(self, entry: _Entry[T]) -> bool:
        """Takes a still-queued entry out of the queue (True), or leaves one a runner took (False)."""
        with self._cond:
            if not entry.queued:
                return False
            group = self._groups[entry.group]
            group.remove(entry)
            if not group:
                del self._groups[entry.group]
            entry.queued = False
            self._queued_bytes -= entry.nbytes
            self._depth -= 1
            if self._gathering is not None:
                # A runner waits for more of a group whose totals (or head) just changed: it plans again.
                # Left waiting, it would hear no arrival of another group, whose turn it now is.
                self._cond.notify()
        self._report_depth()
        self._changed.set()
        return True

    def _expire(self, entry: _Entry[T]) -> None:
        if self._withdraw(entry) and not entry.future.done():
            entry.future.set_exception(DeadlineExpired("the request's deadline passed while it waited in the queue"))
            self._observer.dropped("deadline_exceeded")

    # -- the runners' side (on each runner's thread) ---------------------------------------

    def serve(
        self, run: Runner, done: BatchDone | None = None, *, shared: Runner | None = None, second: bool = False
    ) -> None:
        """Takes batches and runs them on the calling thread until the batcher stops.

        Called once per runner, on the runner's own thread (a device worker's lane), after `start`.
        Each batch's results go to the loop in one callback; `done`, if given, hears of it there first.
        Pairing (module docstring): `shared` runs a batch on a share of the worker's threads, beside
        another; a `second` runner takes only such batches, and only while a first one computes one.
        """
        loop = self._loop
        assert loop is not None, "start() the batcher on its event loop first"
        assert shared is not None or not second, "a second runner computes shared batches only"
        pairs = shared is not None and self._limits.pair_work > 0
        if second:
            with self._cond:
                self._seconds += 1
        batch: _Batch[T] | None = None  # taken and not yet handed back
        busy = False  # requests arrived while this runner computed its last batch
        try:
            while (taking := self._take(busy, pairs, second)) is not None:
                batch, admitted = taking
                results: list | None = None  # with error: each request's result or _Alone
                error: BaseException | None = None
                runner = shared if batch.shared and shared is not None else run
                try:
                    results = runner(batch.items)
                except WorkerLost:
                    raise  # the runner's end, not the batch's: below
                except Exception as exc:  # the batch's failure, not the runner's: it serves on
                    error = exc
                    if len(batch.items) > 1:  # each request alone: only those that fail so fail
                        results = [_run_alone(runner, item) for item in batch.items]
                with self._cond:
                    # Its requests are out (their answers about to go): their clients may send again.
                    self._computing -= len(batch.entries)
                    if batch.shared:
                        self._sharing -= 1
                # Counted before the answers go out: a lone client's next request, sent once it has
                # its answer, must not count, however late this thread reaches its next batch.
                busy = self._admitted > admitted
                taken, batch = batch, None
                if not self._post(loop, self._batch_done, taken, results, error, done):
                    return
        except BaseException as exc:  # a bug here must fail the waiting callers, never strand them
            if batch is not None:  # the runner's own batch too
                self._post(loop, self._batch_done, batch, None, exc, done)
            if not self._post(loop, self._die, exc):  # _die logs it, on the loop
                log.critical("the batcher failed after its event loop closed", exc_info=exc)
        finally:
            if second:
                with self._cond:
                    self._seconds -= 1

    def _take(self, busy: bool, pairs: bool = False, second: bool = False) -> tuple[_Batch[T], int] | None:
        """Waits for a batch that may run now and takes it out of the queue: the batch, and the
        admissions so far; None once stopped. `busy`: requests arrived while this runner computed its
        previous batch (it may linger). `pairs`: this runner may split a batch or share the threads;
        `second`: it takes only shared batches, while a first runner computes one (pairing)."""
        limits = self._limits
        delay = limits.max_queue_delay_s
        loop = self._loop
        assert loop is not None
        cond = self._second_cond if second else self._cond
        with cond:
            # Requests arrived while this runner computed its last batch: clients are ahead of it,
            # so a small batch may wait for more (lingering, the module docstring).
            linger = limits.max_linger_s if busy else 0.0
            while True:
                if self._stopped or self._broken is not None or loop.is_closed():
                    return None
                head = self._oldest()
                # A second runner waits while no shared batch computes: the first runner then has, or
                # is about to take, every thread.
                if head is None or (second and not self._sharing):
                    cond.wait(IDLE_CHECK_S)
                    continue
                now = time.monotonic()
                count, full, work = self._plan(head.group)
                close_at = head.enqueued + delay
                closes_at_work = 0
                if linger and work < limits.linger_work:
                    # Too little work to pay for a batch: no pipelining cap, and wait for more.
                    count, full, work = self._plan(head.group, pipeline=False)
                    if not full and work < limits.linger_work and not self._all_in():
                        close_at = max(close_at, head.enqueued + linger)
                        closes_at_work = limits.linger_work
                if not (full or self._closing or close_at <= now):
                    # Not full, so the plan was uncapped and counted the whole group. Until close_at only
                    # an arrival that may close the batch wakes this runner (submit; a second runner
                    # hears every arrival, as before).
                    if not second:
                        self._gathering = _Gathering.of(head.group, self._groups[head.group], closes_at_work)
                    cond.wait(close_at - now)
                    self._gathering = None
                    continue
                shared = second or (pairs and self._sharing > 0)  # beside a shared batch computing now
                split = pairs and not shared and self._seconds > 0 and count > 1 and 0 < 2 * limits.pair_work <= work
                if split:
                    count = self._half(head.group, count, work)
                batch = self._pop(head.group, count, now)
                if self._groups:
                    self._cond.notify()  # more may run: another idle runner's turn
                if batch.entries:
                    self._in_flight.add(batch)
                    self._computing += len(batch.entries)
                    if shared or split:
                        batch.shared = True
                        self._sharing += 1
                        if self._groups:
                            self._second_cond.notify()  # the rest may compute beside it
                    return batch, self._admitted

    def _all_in(self) -> bool:
        """Whether every request the clients keep in play is queued or computing (under the lock):
        none can come before an answer goes out, so a lingering batch waits for nothing."""
        return self._depth + self._computing >= max(self._in_play_now, self._in_play_before)

    def _count_in_play(self, now: float) -> None:
        """Samples the requests in play at an admission (under the lock), in windows of IN_PLAY_WINDOW_S."""
        if now >= self._window_ends:
            recent = now < self._window_ends + IN_PLAY_WINDOW_S  # the window just ended, not an older one
            self._in_play_before = self._in_play_now if recent else 0
            self._in_play_now = 0
            self._window_ends = now + IN_PLAY_WINDOW_S
        self._in_play_now = max(self._in_play_now, self._depth + self._computing)

    def _oldest(self) -> _Entry[T] | None:
        heads = [q[0] for q in self._groups.values()]
        return min(heads, key=lambda e: e.enqueued) if heads else None

    def _plan(self, group: Hashable, pipeline: bool = True) -> tuple[int, bool, int]:
        """How many queued entries of `group` fit one batch, whether that batch is full, and its work
        (`pipeline` False: without the pipelining cap)."""
        limits = self._limits
        count = sequences = longest = memory = work = 0
        queue = self._groups.get(group, ())
        cap = len(queue)
        most_work = 0
        if pipeline and limits.pipeline and limits.max_queue_delay_s <= 0:  # a delay asks for full batches: no cap
            cap = max(1, (self._last_taken + len(queue)) // 2)
            most_work = limits.pipeline_work
        for entry in queue:
            if count >= cap:
                return count, True, work
            total = sequences + entry.sequences
            tokens = total * max(longest, entry.length)
            more = memory + entry.memory
            over = total > limits.max_batch_size or tokens > limits.max_batch_tokens
            if count and (over or more > limits.max_batch_memory_bytes):
                return count, True, work
            count, sequences, longest, memory = count + 1, total, max(longest, entry.length), more
            work += entry.work
            if sequences >= limits.max_batch_size or tokens >= limits.max_batch_tokens:
                return count, True, work
            if most_work and work >= most_work and sequences >= PIPELINE_MIN_SEQUENCES:
                return count, True, work
        return count, False, work

    def _half(self, group: Hashable, count: int, work: int) -> int:
        """How many of the first `count` entries of `group` hold at least half of their `work` (pairing's
        first half; fewer than `count`)."""
        taken = done = 0
        for entry in self._groups[group]:
            if taken and (done >= work / 2 or taken + 1 >= count):
                break
            taken, done = taken + 1, done + entry.work
        return taken

    def _pop(self, key: Hashable, count: int, now: float) -> _Batch[T]:
        """The first `count` entries of a group, less those whose deadline has passed (they are
        failed on the loop instead of computed)."""
        group = self._groups[key]
        taken = [group.popleft() for _ in range(count)]
        self._last_taken = count
        if not group:
            del self._groups[key]
        self._depth -= count
        self._queued_bytes -= sum(e.nbytes for e in taken)
        live, late = [], []
        for entry in taken:
            entry.queued = False
            (live if entry.expires > now else late).append(entry)
        if late:
            assert self._loop is not None
            self._post(self._loop, self._expired, late)
        return _Batch(live, [now - e.enqueued for e in live])

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: object) -> bool:
        """Runs `callback(*args)` on the loop; False if the loop has closed (the server is gone)."""
        try:
            loop.call_soon_threadsafe(callback, *args)
            return True
        except RuntimeError:
            return False

    # -- answers (on the loop) -------------------------------------------------------------

    def _batch_done(
        self, batch: _Batch[T], results: list[R] | None, error: BaseException | None, done: BatchDone | None
    ) -> None:
        with self._cond:
            self._in_flight.discard(batch)
        entries = batch.entries
        try:
            self._observer.batch_started(len(entries), batch.waits_s)
            if done is not None:
                done(batch.items, None if error is not None else results, error)
        except Exception:  # a report is not worth a batch: log it, answer anyway
            log.exception("reporting a finished batch failed")
        self._report_depth()
        if error is not None and results is not None:  # it failed whole, then each request ran alone
            self._answer_alone(entries, results, error, done)  # type: ignore[arg-type]
            self._changed.set()
            return
        if error is None and results is not None and len(results) != len(entries):
            error = RuntimeError(f"runner returned {len(results)} results for {len(entries)} requests")
        if error is not None:
            log.error("batch of %d requests failed", len(entries), exc_info=error)
            if not isinstance(error, ServingError):  # a domain error keeps its status (WorkerLost: UNAVAILABLE)
                error = BatchFailed(f"the batch failed on its worker: {type(error).__name__}: {error}")
            self._fail(entries, error)
        else:
            for entry, result in zip(entries, results, strict=True):  # type: ignore[arg-type]
                if not entry.future.done():  # the caller may have gone while it ran
                    entry.future.set_result(result)
        self._changed.set()

    def _answer_alone(
        self, entries: list[_Entry[T]], outcomes: list[R | _Alone], error: BaseException, done: BatchDone | None
    ) -> None:
        """Answers a failed batch's requests from their runs alone: each alone run is a batch of one to
        `done` (metrics, statistics), and only a request that failed alone is answered with its failure."""
        failed = sum(isinstance(o, _Alone) for o in outcomes)
        log.error(
            "batch of %d requests failed; each ran again alone: %d answered, %d failed",
            len(entries), len(entries) - failed, failed, exc_info=error,
        )  # fmt: skip
        for entry, outcome in zip(entries, outcomes, strict=True):
            alone_error = outcome.error if isinstance(outcome, _Alone) else None
            try:
                if done is not None:
                    done([entry.item], None if alone_error else [outcome], alone_error)  # type: ignore[list-item]
            except Exception:  # a report is not worth a request: log it, answer anyway
                log.exception("reporting a request run alone failed")
            if entry.future.done():  # the caller may have gone while it ran
                continue
            if isinstance(alone_error, ServingError):  # its own status (DeviceOutOfMemory: RESOURCE_EXHAUSTED)
                entry.future.set_exception(alone_error)
            elif alone_error is not None:
                entry.future.set_exception(
                    BatchFailed(
                        f"the request failed on its worker, alone after its batch of {len(entries)} failed: "
                        f"{type(alone_error).__name__}: {alone_error}"
                    )
                )
            else:
                entry.future.set_result(outcome)

    def _expired(self, entries: list[_Entry[T]]) -> None:
        for entry in entries:
            if not entry.future.done():
                entry.future.set_exception(DeadlineExpired("the request's deadline passed before a worker reached it"))
                self._observer.dropped("deadline_exceeded")
        self._report_depth()
        self._changed.set()

    def _die(self, exc: BaseException) -> None:
        log.critical("the batcher failed", exc_info=exc)
        with self._cond:
            self._broken = BatcherStopped(f"the model's batcher stopped: {exc!r}; the server is stopping")
            self._cond.notify_all()
            self._second_cond.notify_all()
        self._fail_queued(self._broken)
        if self._on_broken is not None:
            self._on_broken(exc)

    def _fail_queued(self, error: Exception) -> None:
        with self._cond:
            queued = [entry for group in self._groups.values() for entry in group]
            for entry in queued:
                entry.queued = False
            self._groups.clear()
            self._queued_bytes = self._depth = 0
        self._fail(queued, error)
        self._report_depth()
        self._changed.set()

    @staticmethod
    def _fail(entries: list[_Entry[T]], error: Exception) -> None:
        for entry in entries:
            if not entry.future.done():
                entry.future.set_exception(error)

    # -- shutdown --------------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> bool:
        """Refuses new items, runs everything queued without waiting for delays, waits for it.

        Returns False if work was still pending after `timeout_s`; that work fails UNAVAILABLE. With
        no time at all (a grace of 0), nothing queued starts: it fails UNAVAILABLE at once, rather than
        racing the runners that would take it.
        """

        def busy() -> bool:
            with self._cond:
                return bool(self._depth or self._in_flight)

        if timeout_s <= 0:
            pending = busy()
            await self.close()
            return not pending
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            self._second_cond.notify_all()
        self._report_depth()

        async def settled() -> None:
            while busy():
                self._changed.clear()
                await self._changed.wait()

        try:
            if busy():  # (a zero timeout would report a drain with nothing left as run out)
                await asyncio.wait_for(settled(), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            await self.close()

    async def close(self) -> None:
        """Stops batching: runners return after their current batch, whose callers (and anyone
        still queued) fail with UNAVAILABLE at once."""
        self.halt()
        with self._cond:
            running = [entry for batch in self._in_flight for entry in batch.entries]
        self._fail(running, ShuttingDown("the server stopped while this request ran"))
        self._fail_queued(ShuttingDown("the server stopped before this request ran"))

    def halt(self) -> None:
        """Tells every runner to return once its current batch is done. Safe from any thread."""
        with self._cond:
            self._closing = self._stopped = True
            self._cond.notify_all()
            self._second_cond.notify_all()
