"""Puts a servicer on the gRPC server with request parsing of our own, so no bytes can break a call
(a large request's tensors stay uncopied, and a head seen before is not parsed again: payload.py),
and response serializing that sends a `framing.Frame` as it is.

gRPC's generated registration parses each request before the handler runs, and a DecodeError there
answers UNKNOWN with a traceback and ends a stream. Here a request that does not parse arrives as an
`Undecodable` instead: a unary call answers INVALID_ARGUMENT in one line, and a stream's handler
answers that message in band and goes on (see `in_band_error`).

With `calls`, the service's handlers are counted while they run, so a stopping server knows when
every call it took has been answered (`CallsInFlight`). With `streams`, its streams count against the
most a process keeps open (`OpenStreams`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from attnserve_server.edge import payload
from attnserve_server.edge.framing import Frame
from attnserve_server.errors import Unauthenticated
from attnserve_server.security import TokenAuth, allowed_models

log = logging.getLogger(__name__)
_LOG_EVERY_S = 60.0
# The largest request a method without tensors takes (health, reflection, metadata, shared memory
# regions): each is a few names and numbers. A larger one is refused unparsed: protobuf copied and checked
# a 100 MiB name, and the servicer hashed it, on the event loop (others' slowest W1 request 230-580 ms).
MAX_CONTROL_BYTES = 64 * 1024
_last_logged: dict[str, float] = {}  # peer host -> when an undecodable request from it was last logged


@dataclass(frozen=True, slots=True)
class Undecodable:
    """Bytes that did not parse as the method's request message."""

    message_type: str
    error: str

    @property
    def status_message(self) -> str:
        return f"request: not a valid {self.message_type} message ({self.error})"


def note_undecodable(request: Undecodable, method: str, peer: str) -> None:
    """Logs an undecodable request at most once a minute per peer host (a client sending garbage
    in a loop must not flood the log)."""
    host = peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer
    now = time.monotonic()
    if now - _last_logged.get(host, -_LOG_EVERY_S) >= _LOG_EVERY_S:
        if len(_last_logged) > 10_000:
            _last_logged.clear()
        _last_logged[host] = now
        log.warning("%s from %s: %s (logged once a minute per peer)", method, host, request.status_message)


OnUndecodable = Callable[[Undecodable, str, str], None]  # (request, method, peer)


class Emptied:
    """Lets a stopping server wait until a count its owner keeps on the event loop falls to nothing:
    the owner calls `reached` when it does, and `wait` is given whether anything is left now."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None  # while `wait` waits

    def reached(self) -> None:
        if self._event is not None:
            self._event.set()

    async def wait(self, left: bool, timeout_s: float) -> bool:
        """Waits, if anything is `left`, until `reached` (True), or `timeout_s` (False)."""
        if not left:
            return True
        self._event = asyncio.Event()
        try:
            await asyncio.wait_for(self._event.wait(), max(0.0, timeout_s))
            return True
        except TimeoutError:
            return False
        finally:
            self._event = None


class CallsInFlight:
    """How many calls of the counted services are in their handlers (on the event loop).

    gRPC's own stop waits, for as long as its grace allows, until every client has closed its
    connection, and a client with an idle channel (perf_analyzer's, or any that ignores HTTP/2
    GOAWAY) never does: a server under such load used to take its whole grace to exit. The front
    waits for this count instead, then gives gRPC a short grace of its own (`front.CLOSE_GRACE_S`).
    """

    def __init__(self) -> None:
        self.count = 0
        self._idle = Emptied()

    def enter(self) -> None:
        self.count += 1

    def exit(self) -> None:
        self.count -= 1
        if not self.count:
            self._idle.reached()

    async def settled(self, timeout_s: float) -> bool:
        """Waits until no counted call is running (True), or `timeout_s` (False)."""
        return await self._idle.wait(self.count > 0, timeout_s)


class OpenStreams:
    """The streams open in this gRPC process, of every service registered with it, and the most it keeps
    open (`limit`, max_open_streams; 0: no limit). A stream that would pass it is refused
    RESOURCE_EXHAUSTED as it opens; the others, and unary calls, go on.

    gRPC takes every stream a client opens, on as many connections as it likes: each open stream, idle
    or not, held about 30 KiB of the server for as long as its client kept it (6,628 held by one client
    process on 40 connections: +206 MiB; 20,000 health watches: +430 MiB)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self.refused = 0  # streams refused so far

    async def open(self, context: grpc.aio.ServicerContext) -> None:
        """Counts a stream opening, or refuses it (the call ends RESOURCE_EXHAUSTED: nothing to `close`)."""
        if self.limit and self.count >= self.limit:
            self.refused += 1
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"streams: the server process on this connection has {self.count} open, the most one keeps "
                f"(max_open_streams {self.limit}); close one, or retry later",
            )
        self.count += 1

    def close(self) -> None:
        self.count -= 1


def _counted(handler, streams: OpenStreams):
    """The stream handler, counted in `streams` while it runs (refused if they are full)."""
    if inspect.isasyncgenfunction(handler):

        async def stream(request, context: grpc.aio.ServicerContext):
            await streams.open(context)
            try:
                async for response in handler(request, context):
                    yield response
            finally:
                streams.close()

        return stream
    if not inspect.iscoroutinefunction(handler):
        raise TypeError(f"{handler!r}: a stream's handler is an async generator, or a coroutine that writes")

    async def written(request, context: grpc.aio.ServicerContext):  # a handler that writes with context.write
        await streams.open(context)
        try:
            return await handler(request, context)
        finally:
            streams.close()

    return written


def _parser(cls, fields: payload.Fields | None, request_id: str | None):
    """Bytes -> the request message (a `payload.Received` where `fields` names its tensor bytes), or
    an Undecodable (as is a message over MAX_CONTROL_BYTES for a method without tensors)."""
    name = cls.DESCRIPTOR.full_name
    read = cls.FromString if fields is None else payload.Parser(cls, fields, request_id)
    most = MAX_CONTROL_BYTES if fields is None else None

    def parse(data: bytes):
        if most is not None and len(data) > most:
            return Undecodable(name, f"{len(data):,} bytes, where this method takes at most {most:,}")
        try:
            return read(data)
        except DecodeError as exc:
            return Undecodable(name, str(exc).splitlines()[0][:200] if str(exc) else "cannot parse")

    return parse


def _serializer(cls):
    """The response's wire bytes: a Frame's parts joined (framing.py), or protobuf's serialization."""
    serialize = cls.SerializeToString

    def serializer(response) -> bytes:
        return response.take() if type(response) is Frame else serialize(response)

    return serializer


async def _authorise(auth: TokenAuth | None, context: grpc.aio.ServicerContext) -> None:
    """Checks the call's bearer token before anything of the request is looked at, and lets the
    handler know which models it may use (security.allowed_models)."""
    if auth is None:
        return
    try:
        allowed_models.set(auth.authenticate(context.invocation_metadata()))
    except Unauthenticated as exc:
        await context.abort(grpc.StatusCode[exc.status], exc.message)


def _unary(handler, method: str, auth: TokenAuth | None, calls: CallsInFlight | None, undecodable: OnUndecodable):
    async def unary(request, context: grpc.aio.ServicerContext):
        if calls is not None:
            calls.enter()
        try:
            if auth is not None:
                await _authorise(auth, context)
            if isinstance(request, Undecodable):
                undecodable(request, method, context.peer())
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.status_message)
            return await handler(request, context)
        finally:
            if calls is not None:
                calls.exit()

    return unary


def _streaming(handler, auth: TokenAuth | None, calls: CallsInFlight | None):
    async def streaming(request_iterator, context: grpc.aio.ServicerContext):
        if calls is not None:
            calls.enter()
        try:
            await _authorise(auth, context)
            async for response in handler(request_iterator, context):
                yield response
        finally:
            if calls is not None:
                calls.exit()

    return streaming


def _parsed_only(handler, method: str):
    """A stream whose servicer knows nothing of Undecodable (reflection's): a message that does not parse
    ends the call INVALID_ARGUMENT, as a unary call's would, instead of reaching the servicer (which
    raised AttributeError on it: UNKNOWN, and a traceback in the log for each such message)."""

    async def stream(request_iterator, context: grpc.aio.ServicerContext):
        async def parsed():
            async for request in request_iterator:
                if isinstance(request, Undecodable):
                    note_undecodable(request, method, context.peer())
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.status_message)
                yield request

        async for response in handler(parsed(), context):
            yield response

    return stream


_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_service(
    server: grpc.aio.Server,
    servicer: object,
    service: ServiceDescriptor,
    auth: TokenAuth | None = None,
    calls: CallsInFlight | None = None,
    undecodable: OnUndecodable = note_undecodable,
    streams: OpenStreams | None = None,
) -> None:
    """Registers every method of `service` that `servicer` implements (others answer UNIMPLEMENTED);
    with `auth`, every call needs a known bearer token; with `calls`, every call is counted while
    its handler runs; with `streams`, every streaming call counts against their limit while it is open.
    A method named in the servicer's `TENSOR_FIELDS` gets its requests as
    `payload.Received`, their tensor bytes uncopied; the servicer's `REQUEST_ID` names the field in
    which each request may carry an id of its own without losing its repeated head (payload.Parser).
    `undecodable(request, method, peer)` hears of each request to such a unary method that did not parse
    (streams' own handlers answer theirs in band); other methods' are only logged."""
    tensor_fields: dict[str, payload.Fields] = getattr(servicer, "TENSOR_FIELDS", {})
    request_id: str | None = getattr(servicer, "REQUEST_ID", None)  # its requests' id field, if any
    handlers = {}
    for method in service.methods:
        behaviour = getattr(servicer, method.name, None)
        if behaviour is None:
            continue
        if not method.client_streaming and inspect.iscoroutinefunction(behaviour):
            told = undecodable if method.name in tensor_fields else note_undecodable
            behaviour = _unary(behaviour, method.name, auth, calls, told)
        elif method.client_streaming and inspect.isasyncgenfunction(behaviour):
            if method.name not in tensor_fields:  # ours answer undecodables in band; others cannot
                behaviour = _parsed_only(behaviour, method.name)
            wrap = auth is not None or calls is not None
            behaviour = _streaming(behaviour, auth, calls) if wrap else behaviour
        if streams is not None and (method.client_streaming or method.server_streaming):
            behaviour = _counted(behaviour, streams)
        handlers[method.name] = _KINDS[(method.client_streaming, method.server_streaming)](
            behaviour,
            request_deserializer=_parser(
                GetMessageClass(method.input_type), tensor_fields.get(method.name), request_id
            ),
            response_serializer=_serializer(GetMessageClass(method.output_type)),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.63: no per-call lookup by name
        server.add_registered_method_handlers(service.full_name, handlers)
