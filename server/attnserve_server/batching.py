"""Admission and dynamic batching: a bounded queue per model that forms batches for its runners.

Knows neither protobuf nor devices. A batch is formed when a runner is free: it starts
with the oldest waiting request, takes the requests behind it that run the same
computation (same group), and closes when it reaches max_batch_size sequences or
max_batch_tokens padded tokens, or max_queue_delay after its first request arrived.
While every runner is busy, requests simply queue, so batches grow with load.
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


async def _failed(exc: Exception):
    raise exc


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
    """Admits items, batches them, runs each batch on a free runner, answers every caller."""

    def __init__(self, runners: Sequence[Runner], limits: BatchLimits, observer: BatchObserver | None = None) -> None:
        if not runners:
            raise ValueError("a batcher needs at least one runner")
        self._runners = list(runners)
        self._limits = limits
        self._observer = observer or _NoObserver()
        self._groups: dict[Hashable, deque[_Entry[T]]] = {}
        self._depth = 0
        self._queued_bytes = 0
        self._closing = False
        self._arrived = asyncio.Event()
        self._idle: asyncio.Queue[Runner] = asyncio.Queue()
        self._running: set[asyncio.Task] = set()
        self._changed = asyncio.Event()  # set whenever depth or running batches change
        self._loop_task: asyncio.Task | None = None
        self._broken: ServingError | None = None
        self._listeners: list[Callable[[int, int, bool], None]] = []

    @property
    def depth(self) -> int:
        return self._depth

    def start(self) -> None:
        for runner in self._runners:
            self._idle.put_nowait(runner)
        self._loop_task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")
        self._loop_task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        # A bug that kills the loop must not leave callers waiting forever.
        if task.cancelled() or task.exception() is None:
            return
        log.critical("the batching loop died", exc_info=task.exception())
        self._broken = ServingError(f"the model's batcher stopped: {task.exception()!r}")
        self._fail_queued(self._broken)

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
        self._arrived.set()
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

    async def _next_batch(self) -> list[_Entry[T]]:
        loop = asyncio.get_running_loop()
        while True:
            head = self._oldest()
            if head is None:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            close_at = head.enqueued + self._limits.max_queue_delay_s
            while not self._closing and not self._plan(head.group)[1]:
                remaining = close_at - loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except TimeoutError:
                    break
            count, _ = self._plan(head.group)
            if count:
                # Depth first: if reporting it fails, the loop dies with the entries still
                # queued, and _loop_ended fails them instead of losing them.
                group = self._groups[head.group]
                self._queued_bytes -= sum(group[i].nbytes for i in range(count))
                self._set_depth(self._depth - count)
                batch = [group.popleft() for _ in range(count)]
                if not group:
                    del self._groups[head.group]
                for entry in batch:
                    entry.queued = False
                return batch

    async def _loop(self) -> None:
        while True:
            runner = await self._idle.get()
            try:
                batch = await self._next_batch()
            except BaseException:
                self._idle.put_nowait(runner)
                raise
            started = asyncio.get_running_loop().time()
            self._observer.batch_started(len(batch), [started - e.enqueued for e in batch])
            # Called here, not in the task: a runner that submits its work when called (the model's
            # does, to its device thread) has the batch on the device before this loop yields.
            try:
                pending = runner([e.item for e in batch])
            except Exception as exc:
                pending = _failed(exc)
            task = asyncio.get_running_loop().create_task(self._run(runner, batch, pending))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, runner: Runner, batch: list[_Entry[T]], pending: Awaitable[list[R]]) -> None:
        released = False
        try:
            try:
                results = await pending
                if len(results) != len(batch):
                    raise RuntimeError(f"runner returned {len(results)} results for {len(batch)} requests")
            except asyncio.CancelledError:
                self._fail(batch, ShuttingDown("the server stopped while this request ran"))
                raise
            except Exception as exc:
                log.exception("batch of %d requests failed", len(batch))
                self._fail(batch, BatchFailed(f"the batch failed on its worker: {type(exc).__name__}: {exc}"))
                return
            # Free the runner and yield once before waking this batch's callers: the batching loop,
            # woken first, hands the runner its next batch, so the device computes while this loop
            # encodes and sends the answers, instead of waiting for all of them.
            self._idle.put_nowait(runner)
            released = True
            await asyncio.sleep(0)
            for entry, result in zip(batch, results, strict=True):
                if not entry.future.done():  # the caller may have gone while it ran
                    entry.future.set_result(result)
        finally:
            if not released:
                self._idle.put_nowait(runner)
            self._changed.set()

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
        self._arrived.set()
        self._tell_listeners()

        async def settled() -> None:
            # _running still holds a task until just after its done-callback runs.
            while self._depth or any(not t.done() for t in self._running):
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
        self._closing = True
        tasks = [t for t in (self._loop_task, *self._running) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_queued(ShuttingDown("the server stopped before this request ran"))
