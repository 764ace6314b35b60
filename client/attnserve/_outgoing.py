"""A stream's requests as its call reads them: the caller's iterable, each request numbered and encoded.

gRPC reads the requests on a thread (the sync client) or a task (grpc.aio) of its own. When the caller's
iterable raises, or a request fails to encode, gRPC cancels the call and reports only UNKNOWN "Exception
iterating requests!" (grpc.aio: an INTERNAL, or nothing at all), while the caller's exception goes to
gRPC's log. Here it ends the requests instead: the answers to those already sent still come back, and
then the caller's own exception is raised from the iteration over the answers (`raise_error`).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

from attnserve._codec import encode_stream_request
from attnserve._types import Request
from attnserve.v1 import attention_pb2 as pb

Spec = Request | Mapping[str, Any]


class _Outgoing:
    __slots__ = ("_index", "error")

    def __init__(self) -> None:
        self._index = 0
        self.error: Exception | None = None

    def _encode(self, spec: Spec) -> pb.AttendRequest:
        msg = encode_stream_request(self._index, spec)
        self._index += 1
        return msg

    def raise_error(self) -> None:
        """Raises the exception that ended the requests, if one did."""
        if self.error is not None:
            raise self.error


class StreamRequests(_Outgoing, Iterator[pb.AttendRequest]):
    """The requests of a stream from an iterable."""

    __slots__ = ("_requests",)

    def __init__(self, requests: Iterable[Spec]) -> None:
        super().__init__()
        self._requests = iter(requests)

    def __next__(self) -> pb.AttendRequest:
        if self.error is not None:
            raise StopIteration
        try:
            return self._encode(next(self._requests))
        except StopIteration:
            raise
        except Exception as exc:
            self.error = exc
            raise StopIteration from None


class AsyncStreamRequests(_Outgoing, AsyncIterator[pb.AttendRequest]):
    """The requests of a stream from an async iterable (an async generator fed by a queue, say)."""

    __slots__ = ("_requests",)

    def __init__(self, requests: AsyncIterable[Spec]) -> None:
        super().__init__()
        self._requests = aiter(requests)

    async def __anext__(self) -> pb.AttendRequest:
        if self.error is not None:
            raise StopAsyncIteration
        try:
            return self._encode(await anext(self._requests))
        except StopAsyncIteration:
            raise
        except Exception as exc:
            self.error = exc
            raise StopAsyncIteration from None
