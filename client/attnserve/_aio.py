"""The asyncio client: the same methods as Client, awaitable."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnserve._channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TARGET,
    CallDefaults,
    channel_credentials,
    channel_options,
    resolve_target,
)
from attnserve._codec import decode_model, decode_response, encode_request
from attnserve._errors import AttnServeError, status_code_from_number, translate_errors
from attnserve._outgoing import AsyncStreamRequests, StreamRequests
from attnserve._types import AttendResult, ModelInfo, Request
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import attention_pb2_grpc as pb_grpc

# grpc.aio writes a stream's requests from a task of its own, which races the call's end: a write or the
# half-close that core refuses because the call has just ended (its deadline passed, or the server closed it)
# before its status reached Python makes grpc.aio set the status to INTERNAL "Internal error from Core" in
# place of the real one, or cancel the call, so that reading it raises asyncio.CancelledError in a task that
# nobody cancelled. With short deadlines and a few streams open, most expired streams ended so, and about a
# quarter of streams that the server ended early (grpcio 1.85; tests/test_server.py). The sync client's
# writer thread does not race so.
_LOST_STATUS = "Internal error from Core"


# The server cancels a stream whose deadline has passed (RST_STREAM), which the client's core may take for
# the stream's status before its own timer fires: CANCELLED (1 in 400 streams, tests/test_server.py), said
# DEADLINE_EXCEEDED here, as the client's own clock tells.
def _deadline_exceeded() -> AttnServeError:
    return AttnServeError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


# How long a stream whose status grpc.aio lost waits for the real one to arrive from core, at most.
_STATUS_WAIT_S = 0.1


def _cython_status(call: Any) -> tuple[grpc.StatusCode, str] | None:
    """The status the call holds now, read from the Cython call: Python has no public way to read it
    without awaiting, by when grpc.aio may have replaced it. None when it is grpc.aio's own (lost, or its
    own cancel of its writer), when there is none yet, or where a grpcio lacks these internals."""
    try:
        cython_call = call._cython_call
        if cython_call.is_locally_cancelled():
            return None
        status = cython_call._status
        if status is None:
            return None
        code, details = status_code_from_number(int(status.code())), str(status.details() or "")
    except Exception:  # another grpcio's internals: the fallbacks still apply
        return None
    if code == grpc.StatusCode.OK or (code == grpc.StatusCode.INTERNAL and details == _LOST_STATUS):
        return None
    return code, details


class _StreamStatus:
    """The status a stream really ended with, where grpc.aio replaced it. grpc.aio calls its done callbacks
    once, with the first status set: the real one (the server's trailers, or the deadline) if it came
    first, which a failed write then replaces with INTERNAL, kept here; or the INTERNAL, the real one
    arriving from core a moment later without a callback, which `real` waits for."""

    __slots__ = ("first",)

    def __init__(self) -> None:
        self.first: tuple[grpc.StatusCode, str] | None = None

    def __call__(self, call: Any) -> None:  # the done callback
        if self.first is None:
            self.first = _cython_status(call)

    async def real(self, call: Any) -> tuple[grpc.StatusCode, str] | None:
        if self.first is not None:
            return self.first
        try:
            if call._cython_call.is_locally_cancelled():  # no status will come
                return None
        except Exception:
            return None
        waited = time.monotonic() + _STATUS_WAIT_S
        while time.monotonic() < waited:
            await asyncio.sleep(0.001)  # core's status, on its way to this loop
            status = _cython_status(call)
            if status is not None:
                return status
        return None


async def _lost_stream_status(
    exc: BaseException, deadline: float | None, call: Any, status: _StreamStatus
) -> AttnServeError | None:
    """The error a stream that ended so really ended with, as far as the client can tell: its real status
    if grpc.aio kept it or it arrives in _STATUS_WAIT_S; else DEADLINE_EXCEEDED once its deadline has
    passed (grpc's timer and ours run on the same clock; ours started first), as for a CANCELLED that came
    after it (`_deadline_exceeded`); else INTERNAL, saying that the status was lost. None for any other
    error (a real status, or a cancellation of the caller's own task), which is raised as it is."""
    expired = deadline is not None and time.monotonic() >= deadline - 0.001
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        if task is None or task.cancelling():
            return None
    elif exc.code() == grpc.StatusCode.CANCELLED and expired:  # type: ignore[union-attr]
        return _deadline_exceeded()
    elif exc.code() != grpc.StatusCode.INTERNAL or exc.details() != _LOST_STATUS:  # type: ignore[union-attr]
        return None
    real = await status.real(call)
    if real is not None and not (expired and real[0] == grpc.StatusCode.CANCELLED):
        return AttnServeError(*real)
    if expired:
        return _deadline_exceeded()
    return AttnServeError(
        grpc.StatusCode.INTERNAL,
        "the stream ended while the client was still sending its requests, and grpc.aio lost the status "
        f"it ended with ({_LOST_STATUS!r})",
    )


@dataclass(frozen=True, slots=True)
class _Bound:
    """An AsyncClient's channel, bound to the event loop it was made in, and its stubs."""

    loop: asyncio.AbstractEventLoop
    channel: grpc.aio.Channel
    service: pb_grpc.AttentionServiceStub
    health: health_pb2_grpc.HealthStub


class AsyncClient:
    """asyncio client over grpc.aio; same arguments and methods as `Client`.

    It may be made anywhere (at import, say): its channel is opened in the event loop of its first call,
    since grpc.aio binds a channel to one loop. Once that loop has closed (an `asyncio.run` ended), the
    next call opens a new channel in its own loop; a call from another loop while the first is still
    open raises RuntimeError (one client per event loop)."""

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        timeout_s: float | None = None,
        wait_for_ready: bool = False,
        retries: bool = True,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        tls: bool = False,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        token: str | None = None,
        trace: bool = False,
        keepalive_s: float | None = None,
    ) -> None:
        options = channel_options(max_message_bytes, retries, keepalive_s)
        credentials = channel_credentials(tls, ca, cert, key, credentials)
        self._target = resolve_target(target)
        self._options = options
        self._credentials = credentials
        self._call_args = CallDefaults(timeout_s, wait_for_ready, token, trace)
        self._bound: _Bound | None = None  # the channel of the loop that uses it, made at its first call
        self._closed = False

    def _open(self) -> _Bound:
        """The channel and stubs of the running event loop (see the class)."""
        loop = asyncio.get_running_loop()
        bound = self._bound
        if bound is not None and bound.loop is loop:
            return bound
        if self._closed:
            raise grpc.aio.UsageError("Channel is closed.")
        if bound is not None and not bound.loop.is_closed():
            raise RuntimeError(
                "AsyncClient: its channel belongs to another event loop, which is still open; "
                "make one client per event loop"
            )
        channel = (
            grpc.aio.secure_channel(self._target, self._credentials, self._options)
            if self._credentials is not None
            else grpc.aio.insecure_channel(self._target, self._options)
        )
        self._bound = _Bound(loop, channel, pb_grpc.AttentionServiceStub(channel), health_pb2_grpc.HealthStub(channel))
        return self._bound

    async def attend(
        self, query: Any, key_value: Any = None, *, timeout_s: float | None = None, **fields: Any
    ) -> AttendResult:
        msg = encode_request(Request(query=query, key_value=key_value, **fields))
        stub = self._open().service
        with translate_errors():
            return decode_response(await stub.Attend(msg, **self._call_args(timeout_s)))

    async def attend_stream(
        self,
        requests: Iterable[Request | Mapping[str, Any]] | AsyncIterable[Request | Mapping[str, Any]],
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[AttendResult]:
        """As `Client.attend_stream`; `requests` may also be an async iterable (an async generator
        fed by a queue, say), read as the stream goes: each request is sent when it is produced,
        while earlier answers are already coming back."""
        outgoing = AsyncStreamRequests(requests) if isinstance(requests, AsyncIterable) else StreamRequests(requests)
        args = self._call_args(timeout_s)
        timeout = args["timeout"]
        deadline = None if timeout is None else time.monotonic() + timeout  # type: ignore[operator]
        call = self._open().service.AttendStream(outgoing, **args)
        status = _StreamStatus()
        call.add_done_callback(status)
        try:
            with translate_errors():
                try:
                    async for msg in call:
                        yield decode_response(msg)
                except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
                    if isinstance(exc, grpc.aio.AioRpcError):
                        outgoing.raise_error()
                    lost = await _lost_stream_status(exc, deadline, call, status)
                    if lost is None:
                        raise
                    raise lost from None
            outgoing.raise_error()
        finally:
            call.cancel()

    async def models(self, *, timeout_s: float | None = None) -> list[ModelInfo]:
        stub = self._open().service
        with translate_errors():
            reply = await stub.ListModels(pb.ListModelsRequest(), **self._call_args(timeout_s))
        return [decode_model(m) for m in reply.models]

    async def model(self, name: str = "", *, timeout_s: float | None = None) -> ModelInfo:
        stub = self._open().service
        with translate_errors():
            reply = await stub.GetModel(pb.GetModelRequest(model=name), **self._call_args(timeout_s))
        return decode_model(reply)

    async def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        health = self._open().health
        with translate_errors():
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), **self._call_args(timeout_s))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        self._closed = True
        if self._bound is not None and self._bound.loop is asyncio.get_running_loop():
            await self._bound.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
