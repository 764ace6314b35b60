"""What both edges share: find the model, decode, submit to its batcher, encode, and count it.

An edge passes a `decode(served) -> AttentionRequest` and an `encode(...) -> response`;
`Dispatcher.handle` runs them around the model's batcher and records the request's
metrics (and so its KServe statistics) whatever the outcome. `unary_errors` is the one
place where an exception becomes a gRPC status for a unary call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import NamedTuple, Protocol, TypeVar

import grpc

from attnserve_server.batching import DEADLINE_SLACK_S
from attnserve_server.domain import Answer, AttentionRequest, ModelSpec
from attnserve_server.edge.framing import wire_size
from attnserve_server.edge.outbox import Outbox
from attnserve_server.edge.registration import Undecodable, note_undecodable
from attnserve_server.errors import ModelNotFound, ServingError, ShuttingDown, UnsentAnswers, clip, status_of
from attnserve_server.metrics import InferenceStats, ModelMetrics
from attnserve_server.security import check_model_allowed
from attnserve_server.settings import STREAM_WINDOW, ModelSettings
from attnserve_server.tracing import Tracing

log = logging.getLogger(__name__)
M = TypeVar("M")
R = TypeVar("R")
_END = object()
_CLOSING = object()
STREAM_CLOSED = "the server is shutting down; open the stream again (another replica, or this one once restarted)"


class Servable(Protocol):
    """What the edge needs of a model: `model.ServedModel` in a single-process server, and
    `multiprocess.edge_process.RemoteModel` (the engine's model, over the link) in an edge process."""

    spec: ModelSpec
    settings: ModelSettings
    devices: list[str]
    metrics: ModelMetrics  # the request path's series, counted where the request is handled

    @property
    def ready(self) -> bool: ...

    def check_admission(self) -> None: ...

    async def submit(
        self, request: AttentionRequest, deadline: float | None = None, *, expire: bool = True
    ) -> Answer: ...

    async def statistics(self) -> InferenceStats: ...


# the model -> (the validated request, a timeout in seconds the request itself carries, or None)
Decode = Callable[[Servable], tuple[AttentionRequest, float | None]]
# (the model, the request, its answer, perf_counter() at receipt) -> the edge's response
Encode = Callable[[Servable, AttentionRequest, Answer, float], R]


class Timing(NamedTuple):
    """What a response reports of its request's time in the server, in nanoseconds."""

    queue_ns: int  # receipt to the start of its batch on the worker
    compute_ns: int  # the batch on the worker
    server_ns: int  # receipt to the response

    @classmethod
    def of(cls, answer: Answer, received: float) -> Timing:
        batch = answer.batch
        return cls(
            int((batch.started - received) * 1e9),
            int(batch.compute_s * 1e9),
            int((time.perf_counter() - received) * 1e9),
        )


def caller_status(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status a caller gets for an exception: a ServingError's own code and message, anything
    else INTERNAL, logged here with its traceback (the one place that logs it)."""
    if not isinstance(exc, ServingError):
        log.error("unexpected error in %s", method, exc_info=exc)
    status, message = status_of(exc)
    return grpc.StatusCode[status], message


def unary_errors(handler):
    """A unary handler's exceptions become its call's status (see `caller_status`)."""

    @functools.wraps(handler)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await context.abort(*caller_status(exc, handler.__name__))

    return wrapper


class Dispatcher:
    """An empty model name means the first configured model."""

    def __init__(
        self,
        models: Mapping[str, Servable],
        unknown_model_metrics: ModelMetrics,
        tracing: Tracing | None = None,
        stream_window: int = STREAM_WINDOW,
        outbox: Outbox | None = None,
    ) -> None:
        self.models = models
        self.tracing = tracing
        self.stream_window = stream_window
        self.outbox = Outbox(0) if outbox is None else outbox  # answers owed to connections (edge/outbox.py)
        self.default = next(iter(models))
        self._unknown = unknown_model_metrics
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's, once it handles a call
        self.closing = asyncio.Event()  # set when the front stops: open streams end (`stream`)

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        # Python 3.11's get_running_loop() makes a getpid() system call each time: 1-2% of the
        # loop's time under load (py-spy). A server's loop is its loop for life.
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def model(self, name: str) -> Servable:
        served = self.models.get(name or self.default)
        if served is None:
            raise self._not_found(name)
        check_model_allowed(served.spec.name)
        return served

    def _not_found(self, name: str) -> ModelNotFound:
        return ModelNotFound(f"model: no model named {clip(name)}; served: {', '.join(sorted(self.models))}")

    def undecodable(self, request: Undecodable, method: str, peer: str) -> None:
        """A request that did not parse: logged at most once a minute per client host, and counted under
        model "" with code INVALID_ARGUMENT, as no model could be read from it."""
        note_undecodable(request, method, peer)
        self._unknown.request_started()
        self._unknown.request_done(method, grpc.StatusCode.INVALID_ARGUMENT, 0.0)

    def deadline(self, context: grpc.aio.ServicerContext) -> float | None:
        """The call's deadline on the event loop's clock (None: the caller set none)."""
        remaining = context.time_remaining()
        return None if remaining is None else self._running_loop().time() + remaining

    async def stream(
        self,
        messages: AsyncIterator[M],
        answer: Callable[[M], Awaitable[R]],
        context: grpc.aio.ServicerContext,
        peer: str,
    ) -> AsyncIterator[R]:
        """A bidirectional stream's answers (see `answer_concurrently`); once the server stops and
        every request read has its answer, the stream ends UNAVAILABLE, which tells its client to
        open it again elsewhere.

        `peer` is the call's, read when it started: the tasks that answer its messages may run a moment
        after it ended, and gRPC's `context.peer()` then reads freed memory (a segmentation fault, seen)."""
        # Each answer computed is owed to the connection, at its size on the wire, until it has gone out.
        outbox = self.outbox
        counted = bool(outbox.limit)
        unsent: dict[int, int] = {}  # id(answer) -> its bytes
        ended = False

        async def owed(message: M) -> R:
            response = await answer(message)
            # An answer computed after the stream ended is never sent, and the stream's tasks outlive it a
            # moment (answer_concurrently cancels them without waiting): nothing is owed for it.
            if not ended:
                nbytes = unsent[id(response)] = wire_size(response)
                outbox.owe(peer, nbytes)
            return response

        try:
            async for response in answer_concurrently(
                messages, owed if counted else answer, self.closing, self.stream_window
            ):
                yield response  # resumed once it has gone out
                if counted:
                    outbox.release(peer, unsent.pop(id(response)))
        except ShuttingDown as exc:
            await context.abort(*caller_status(exc, "stream"))
        finally:
            ended = True
            if unsent:  # computed, and not sent: the stream ended first
                outbox.release(peer, sum(unsent.values()))

    def _admit_answers(self, served: Servable, peer: str) -> None:
        try:
            self.outbox.admit(peer)
        except UnsentAnswers:
            served.metrics.dropped("unsent_answers")
            raise

    async def handle(
        self,
        model: str,
        method: str,
        deadline: float | None,
        decode: Decode,
        encode: Encode[R],
        context: grpc.aio.ServicerContext | None = None,
        *,
        stream_peer: str | None = None,
    ) -> R:
        """One request, start to end, with its metrics; raises ServingError (or anything unexpected).

        With `context`, the outbox refuses the request while its connection is owed too much, and counts
        its answer against the connection (edge/outbox.py): a unary call's until the call ends; a stream
        message's (`stream_peer`: its stream's peer, read when the stream started) until it has been
        computed (`stream` counts it from then on).

        `deadline` is the call's (loop clock); a timeout the request carries (KServe's `timeout`
        parameter), counted from receipt, tightens it.
        """
        loop = self._running_loop()
        received_loop = loop.time()
        received = time.perf_counter()
        served = self.models.get(model or self.default)
        metrics = served.metrics if served is not None else self._unknown
        metrics.request_started()
        code = grpc.StatusCode.OK
        span = answer = owed = None
        if self.tracing is not None:
            metadata = context.invocation_metadata() if context is not None else None
            span = self.tracing.request_started(method, model or self.default, metadata)
        try:
            if served is None:
                raise self._not_found(model)
            check_model_allowed(served.spec.name)
            served.check_admission()  # before the tensors are decoded: refusing must be cheap
            peer = None
            if context is not None and self.outbox.limit:
                peer = context.peer() if stream_peer is None else stream_peer
                self._admit_answers(served, peer)
            request, timeout_s = decode(served)
            if peer is not None:
                if stream_peer is None:
                    self.outbox.owe_call(context, peer, request.answer_bytes)  # type: ignore[arg-type]
                else:
                    owed = (peer, request.answer_bytes)
                    self.outbox.owe(*owed)
            if span is not None:
                request = dataclasses.replace(request, trace=span)
            # The RPC deadline cancels this call by itself; only a tighter timeout carried in the
            # request needs the batcher's timer.
            expire = False
            if timeout_s is not None and (deadline is None or received_loop + timeout_s < deadline):
                deadline, expire = received_loop + timeout_s, True
            answer = await served.submit(request, deadline, expire=expire)
            return encode(served, request, answer, received)
        except asyncio.CancelledError:
            expired = deadline is not None and loop.time() >= deadline - DEADLINE_SLACK_S
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except BaseException as exc:
            code = grpc.StatusCode[status_of(exc)[0]]
            raise
        finally:
            if owed is not None:
                self.outbox.release(*owed)
            metrics.request_done(method, code, time.perf_counter() - received)
            if span is not None:
                self.tracing.request_done(span, code.name, received, answer.batch if answer is not None else None)  # type: ignore[union-attr]


async def answer_concurrently(
    messages: AsyncIterator[M],
    answer: Callable[[M], Awaitable[R]],
    closing: asyncio.Event | None = None,
    window: int = STREAM_WINDOW,
) -> AsyncIterator[R]:
    """A stream's requests run concurrently (and batch together); answers go out as they finish.

    At most `window` requests are read and not yet answered and sent: past that the stream is not
    read until an answer has gone out, so HTTP/2 flow control holds a client that sends faster than
    it reads, instead of the server holding its answers without bound. `answer` must not raise
    for a request's own failure (streams answer those in band). Once `closing` is set (the server
    is stopping), the stream ends with ShuttingDown as soon as every request read so far has its
    answer: a client that keeps its stream open cannot hold a stopping server for its whole grace.
    """
    answers: asyncio.Queue = asyncio.Queue()
    unanswered = 0  # requests read and not yet answered
    slots = asyncio.Semaphore(window)  # one per request read and not yet answered and sent

    async def one(msg: M) -> None:
        answers.put_nowait(await answer(msg))

    async def read() -> None:
        nonlocal unanswered
        try:
            async with asyncio.TaskGroup() as group:
                while True:
                    await slots.acquire()
                    try:
                        msg = await anext(messages)
                    except StopAsyncIteration:
                        break
                    unanswered += 1
                    group.create_task(one(msg))
        finally:
            answers.put_nowait(_END)

    async def watch(event: asyncio.Event) -> None:
        await event.wait()
        answers.put_nowait(_CLOSING)

    reader = asyncio.create_task(read())
    watcher = None if closing is None else asyncio.create_task(watch(closing))
    closed = False
    try:
        while True:
            if closed and not unanswered:
                raise ShuttingDown(STREAM_CLOSED)
            item = await answers.get()
            if item is _END:
                break
            if item is _CLOSING:
                closed = True
                continue
            unanswered -= 1
            yield item  # resumed once gRPC has taken the answer
            slots.release()
        await reader
    finally:
        reader.cancel()
        if watcher is not None:
            watcher.cancel()
