"""A request's large tensor bytes as views of the bytes gRPC received, not as copies.

Parsed by upb, a bytes field is copied twice: into the message while it parses, and into a new
bytes object each time it is read. For a 1 MiB request (WL: [256, 1024] fp32) those two copies cost
the event loop ~200 µs of its ~1.8 ms a request (BENCHMARKS.md, sixteenth pass), and the loop is
what an edge runs out of first. So a large message is first scanned at its top level: the tensor
fields are cut out and kept as memoryviews of the received bytes, and protobuf parses what remains,
a few hundred bytes of names, shapes and parameters.

The wire format allows this: a message is a sequence of fields (key, then a varint, 8 or 4 bytes,
or a length and that many bytes), in any order, and a message without some of its fields is still
a valid message. Anything this scanner does not expect (a group, a field that repeats where
protobuf would merge it, a wire type that does not fit, bytes that end early) makes it step aside:
protobuf parses the whole message as before, and reports any error itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Generic, TypeVar

from attnserve_server.edge.framing import varint

M = TypeVar("M")
# Messages shorter than this parse whole: the scan's Python costs more than the copies it saves
# (a W1 request, 64 KiB: ~4 µs of copies).
LARGE_MESSAGE_BYTES = 256 << 10
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
# Where a tensor's bytes are: a top-level field number -> None (the field itself holds them, as a
# repeated bytes field: KServe's raw_input_contents), or the number of the bytes field inside that
# nested message (attnserve.v1's Tensor.data inside AttendRequest.query).
Fields = Mapping[int, int | None]
_NO_VIEWS: Mapping[int, list[memoryview]] = MappingProxyType({})  # shared: a small request allocates none


@dataclass(frozen=True, slots=True)
class Received(Generic[M]):
    """A request message, and the bytes of the fields cut out of it before it was parsed: by
    top-level field number, in the order they came. Empty when the message was parsed whole."""

    message: M
    views: Mapping[int, list[memoryview]] = field(default_factory=lambda: _NO_VIEWS)


class _Unexpected(Exception):
    """Bytes the scanner leaves to protobuf."""


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _Unexpected
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(data: bytes, start: int, end: int):
    """Yields (number, wire type, start of the field, start of its value, end of the field) for each
    field of the message in data[start:end]; a length-delimited value starts after its length."""
    pos = start
    while pos < end:
        at = pos
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            _, pos = _read_varint(data, pos)
            value = pos
        elif wire == _FIXED64:
            value = pos = pos + 8
        elif wire == _FIXED32:
            value = pos = pos + 4
        elif wire == _LENGTH_DELIMITED:
            length, value = _read_varint(data, pos)
            pos = value + length
        else:  # groups: deprecated, and not in these messages
            raise _Unexpected
        if pos > end or number == 0:
            raise _Unexpected
        yield number, wire, at, value, pos


def split(data: bytes, fields: Fields) -> tuple[bytes, dict[int, list[memoryview]]] | None:
    """The message `data` without the tensor bytes `fields` name, and those bytes as views of `data`;
    None where the scanner steps aside (the module's note says when)."""
    view = memoryview(data)
    kept: list[bytes | memoryview] = []
    views: dict[int, list[memoryview]] = {}
    nested_seen: set[int] = set()
    at = 0  # data[at:] not yet kept or cut
    try:
        for number, wire, start, value, end in _fields(data, 0, len(data)):
            if number not in fields:
                continue
            if wire != _LENGTH_DELIMITED:
                return None
            inner = fields[number]
            if inner is None:  # a repeated bytes field: cut the whole field out
                views.setdefault(number, []).append(view[value:end])
                kept.append(view[at:start])
                at = end
                continue
            if number in nested_seen:  # a nested message sent twice: protobuf merges the two
                return None
            nested_seen.add(number)
            found = None
            for n, w, s, v, e in _fields(data, value, end):
                if n == inner:
                    if w != _LENGTH_DELIMITED or found is not None:
                        return None
                    found = (s, v, e)
            if found is None:
                continue
            s, v, e = found
            views[number] = [view[v:e]]
            size = (end - value) - (e - s)
            kept += (view[at:start], varint(number << 3 | _LENGTH_DELIMITED), varint(size), view[value:s], view[e:end])
            at = end
    except _Unexpected:
        return None
    if not at:  # nothing cut (typed contents, say): the message as it came, not a copy of it
        return data, views
    kept.append(view[at:])
    return b"".join(kept), views


def parse(cls, data: bytes, fields: Fields) -> Received:
    """`data` as a message of protobuf class `cls`, its tensor bytes as views when it is large.
    Raises protobuf's DecodeError for bytes that are not such a message."""
    if len(data) >= LARGE_MESSAGE_BYTES:
        got = split(data, fields)
        if got is not None:
            rest, views = got
            return Received(cls.FromString(rest), views)
    return Received(cls.FromString(data))
