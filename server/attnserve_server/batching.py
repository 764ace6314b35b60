"""Admission and dynamic batching: a bounded queue per model that forms batches for its runners.

Knows neither protobuf nor devices. A batch is formed when a runner is free: it starts
with the oldest waiting request, takes the requests behind it that run the same
computation (same group), and closes when it reaches max_batch_size sequences or
max_batch_tokens padded tokens, or max_queue_delay after its first request arrived.
While every runner is busy, requests simply queue, so batches grow with load.
There is no batching task: batches form in the callbacks of the events that allow them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from attnserve_server.errors import BatchFailed, DeadlineExpired, QueueFull, ServingError, ShuttingDown

T = TypeVar("T")
R = TypeVar("R")
Runner = Callable[[list[T]], Awaitable[list[R]]]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int  # sequences
    max_batch_tokens: int  # sequences x longest query length
    max_queue_delay_s: float
    max_queue_size: int  # requests waiting
    max_queue_bytes: int = 1 << 62  # bytes of the requests waiting
    max_batch_memory_bytes: int = 1 << 62  # the sum of a batch's items' memory estimates


# A call the caller cancels this close to its deadline is counted as expired, not cancelled: the
# caller's deadline is ours less the time its request took to arrive, and a client gives up at its
# own (its cancellation then reaches us a moment before our deadline).
DEADLINE_SLACK_S = 0.01


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
    """What the batcher reports (metrics implement it)."""

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
    group: Hashable
    enqueued: float
    future: asyncio.Future = field(repr=False)
    queued: bool = True


class Batcher(Generic[T, R]):
    """Admits items, batches them, runs each batch on a free runner, answers every caller.

    Event-driven, with no task of its own: a batch forms when something changes what could run
    (an item arrives, a runner frees, a batch's delay ends, a drain starts), inside that event's
    own callback. So a request that finds a runner free reaches it in its caller's step, and a
    runner that finishes gets its next batch before the finished batch's callers are woken.
    """

    def __init__(self, runners: Sequence[Runner], limits: BatchLimits, observer: BatchObserver | None = None) -> None:
        if not runners:
            raise ValueError("a batcher needs at least one runner")
        self._limits = limits
        self._observer = observer or _NoObserver()
        self._groups: dict[Hashable, deque[_Entry[T]]] = {}
        self._depth = 0
        self._queued_bytes = 0
        self._closing = False
        self._started = False
        self._stopped = False  # closed: no batch starts any more
        self._free: list[Runner] = list(runners)
        # each batch in flight: the runner's future -> (the runner, the batch's entries)
        self._running: dict[asyncio.Future, tuple[Runner, list[_Entry[T]]]] = {}
        self._changed = asyncio.Event()  # set whenever depth or running batches change
        self._timer: asyncio.TimerHandle | None = None  # ends the head batch's delay
        self._timer_at = 0.0
        self._broken: ServingError | None = None
        self._listeners: list[Callable[[int, int, bool], None]] = []

    @property
    def depth(self) -> int:
        return self._depth

    def start(self) -> None:
        self._started = True
        self._pump()

    # -- admission -------------------------------------------------------------------------

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
    ) -> R:
        """Queues one item and waits for the runner's result for it. `deadline` is on the loop's clock.

        With `expire`, a timer fails the item at its deadline. Without, the caller enforces the deadline
        itself (an RPC deadline cancels the call), which spares a timer per request; the deadline then
        only tells a drop at the deadline from a cancellation.
        """
        self.check_admission()
        if self._queued_bytes + nbytes > self._limits.max_queue_bytes:
            self._observer.dropped("queue_full")
            raise QueueFull(
                f"the model's queue holds {self._queued_bytes} bytes of requests; this one's {nbytes} would pass "
                f"max_queue_bytes {self._limits.max_queue_bytes}; retry later"
            )
        loop = asyncio.get_running_loop()
        entry = _Entry(item, sequences, length, nbytes, memory, group, loop.time(), loop.create_future())
        self._groups.setdefault(group, deque()).append(entry)
        self._queued_bytes += nbytes
        self._set_depth(self._depth + 1)
        self._pump()
        # The one expiry mechanism: a timer at the deadline, which works whether or not a batch
        # forms or an RPC deadline cancels the caller (KServe's `timeout` parameter has no RPC one).
        timer = loop.call_at(deadline, self._expire_entry, entry) if expire and deadline is not None else None
        try:
            return await entry.future
        except asyncio.CancelledError:
            # The caller went away (cancelled, or its deadline passed): drop it before compute.
            if entry.queued:
                self._remove(entry)
                expired = deadline is not None and loop.time() >= deadline - DEADLINE_SLACK_S
                self._observer.dropped("deadline_exceeded" if expired else "cancelled")
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def check_admission(self) -> None:
        """Raises what `submit` would refuse an item with right now (full queue, shutdown), counting
        the drop: the edge asks before it decodes a request, so shedding at overload costs microseconds."""
        if self._broken is not None:
            raise self._broken
        refused = refusal(self._limits, self._depth, self._queued_bytes, self._closing)
        if refused is not None:
            self._observer.dropped(refused[0])
            raise refused[1]

    def watch(self, listener: Callable[[int, int, bool], None]) -> None:
        """Calls `listener(depth, queued bytes, closing)` now and after every change of them: an
        engine publishes them to its edge processes, which then refuse as `check_admission` would."""
        self._listeners.append(listener)
        self._tell_listeners()

    def _set_depth(self, depth: int) -> None:
        self._depth = depth
        self._observer.queue_depth(depth)
        self._changed.set()
        self._tell_listeners()

    def _tell_listeners(self) -> None:
        for listener in self._listeners:
            listener(self._depth, self._queued_bytes, self._closing)

    def _remove(self, entry: _Entry[T]) -> None:
        group = self._groups[entry.group]
        group.remove(entry)
        if not group:
            del self._groups[entry.group]
        entry.queued = False
        self._queued_bytes -= entry.nbytes
        self._set_depth(self._depth - 1)

    # -- batch formation -------------------------------------------------------------------

    def _oldest(self) -> _Entry[T] | None:
        heads = [q[0] for q in self._groups.values()]
        return min(heads, key=lambda e: e.enqueued) if heads else None

    def _plan(self, group: Hashable) -> tuple[int, bool]:
        """How many queued entries of `group` fit one batch, and whether that batch is full."""
        limits = self._limits
        count = sequences = longest = memory = 0
        for entry in self._groups.get(group, ()):
            total = sequences + entry.sequences
            tokens = total * max(longest, entry.length)
            more = memory + entry.memory
            over = total > limits.max_batch_size or tokens > limits.max_batch_tokens
            if count and (over or more > limits.max_batch_memory_bytes):
                return count, True
            count, sequences, longest, memory = count + 1, total, max(longest, entry.length), more
            if sequences >= limits.max_batch_size or tokens >= limits.max_batch_tokens:
                return count, True
        return count, False

    def _expire_entry(self, entry: _Entry[T]) -> None:
        if entry.queued and not entry.future.done():
            self._remove(entry)
            entry.future.set_exception(DeadlineExpired("the request's deadline passed while it waited in the queue"))
            self._observer.dropped("deadline_exceeded")

    def _pump(self, due_by: float = 0.0) -> None:
        """Hands free runners every batch that may run now; if the oldest may not yet (it is not
        full and its delay has not passed), arms a timer for its delay. `due_by`: a timer's time,
        due however the loop's clock rounds."""
        if not self._started or self._stopped or self._broken is not None:
            return
        try:
            loop = asyncio.get_running_loop()
            while self._free and self._groups:
                head = self._oldest()
                assert head is not None
                count, full = self._plan(head.group)
                close_at = head.enqueued + self._limits.max_queue_delay_s
                if not (full or self._closing or close_at <= max(loop.time(), due_by)):
                    self._arm(loop, close_at)
                    return
                self._launch(self._free.pop(), head.group, count)
        except Exception as exc:  # a bug here must fail the waiting callers, never strand them
            self._die(exc)

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            if self._timer_at == at:
                return
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(at, self._delay_ended, at), at

    def _delay_ended(self, at: float) -> None:
        self._timer = None
        self._pump(due_by=at)

    def _launch(self, runner: Runner, key: Hashable, count: int) -> None:
        group = self._groups[key]
        loop = asyncio.get_running_loop()
        now = loop.time()
        # Reports first: if one fails, the entries are still queued and _die fails them.
        self._observer.batch_started(count, [now - group[i].enqueued for i in range(count)])
        self._queued_bytes -= sum(group[i].nbytes for i in range(count))
        self._set_depth(self._depth - count)
        batch = [group.popleft() for _ in range(count)]
        if not group:
            del self._groups[key]
        for entry in batch:
            entry.queued = False
        try:
            # A runner that submits its work when called (the model's does, to its device thread)
            # has the batch on the device before this returns.
            pending = asyncio.ensure_future(runner([e.item for e in batch]))
        except Exception as exc:
            pending = loop.create_future()
            pending.set_exception(exc)
        self._running[pending] = (runner, batch)
        pending.add_done_callback(self._finished)

    def _finished(self, pending: asyncio.Future) -> None:
        runner, batch = self._running.pop(pending)
        # The runner's next batch first, so the device computes while the loop answers this one.
        self._free.append(runner)
        try:
            self._pump()
        finally:
            self._answer(pending, batch)
            self._changed.set()

    def _answer(self, pending: asyncio.Future, batch: list[_Entry[T]]) -> None:
        if pending.cancelled():
            self._fail(batch, ShuttingDown("the server stopped while this request ran"))
            return
        exc = pending.exception()
        results = pending.result() if exc is None else None
        if results is not None and len(results) != len(batch):
            exc = RuntimeError(f"runner returned {len(results)} results for {len(batch)} requests")
        if exc is not None:
            log.error("batch of %d requests failed", len(batch), exc_info=exc)
            self._fail(batch, BatchFailed(f"the batch failed on its worker: {type(exc).__name__}: {exc}"))
            return
        for entry, result in zip(batch, results, strict=True):  # type: ignore[arg-type]
            if not entry.future.done():  # the caller may have gone while it ran
                entry.future.set_result(result)

    def _die(self, exc: Exception) -> None:
        log.critical("the batcher failed", exc_info=exc)
        self._broken = ServingError(f"the model's batcher stopped: {exc!r}")
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            self._fail_queued(self._broken)  # fails every caller first, then reports the depth
        except Exception:
            log.exception("reporting the failed queue failed too")

    def _fail_queued(self, error: Exception) -> None:
        for group in self._groups.values():
            for entry in group:
                entry.queued = False
            self._fail(list(group), error)
        self._groups.clear()
        self._queued_bytes = 0
        self._set_depth(0)

    @staticmethod
    def _fail(entries: list[_Entry[T]], error: Exception) -> None:
        for entry in entries:
            if not entry.future.done():
                entry.future.set_exception(error)

    # -- shutdown --------------------------------------------------------------------------

    async def drain(self, timeout_s: float) -> bool:
        """Refuses new items, runs everything queued without waiting for delays, waits for it.

        Returns False if work was still pending after `timeout_s`; that work fails UNAVAILABLE.
        """
        self._closing = True
        self._tell_listeners()
        self._pump()

        async def settled() -> None:
            while self._depth or self._running:
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(settled(), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            await self.close()

    async def close(self) -> None:
        """Stops batching; anything still queued or running fails with UNAVAILABLE."""
        self._closing = self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        running = list(self._running.items())
        for pending, (_, batch) in running:
            self._fail(batch, ShuttingDown("the server stopped while this request ran"))
            pending.cancel()
        await asyncio.gather(*(pending for pending, _ in running), return_exceptions=True)
        self._fail_queued(ShuttingDown("the server stopped before this request ran"))
