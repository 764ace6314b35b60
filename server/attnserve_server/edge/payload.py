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

Most request streams repeat one head: a client, a load generator, an application sends request after
request whose fields other than the tensor bytes (model, inputs' names, datatypes and shapes,
parameters) are the same bytes each time. A `Parser` remembers the heads it has seen: a message of
a known head's length whose bytes are the head's everywhere but in its tensors' bytes is not parsed
again. It gets the head's message (one object, shared by every such request: read-only) and its
tensor bytes as views, and the decoder may keep what it made of the head (`Repeat.decoded`) for the
next one. Under load at L=16 the loop spent ~12% of its GIL time decoding (py-spy, BENCHMARKS.md,
eighteenth pass).
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


class Repeat:
    """A head seen before: the message it parses to, and the bytes of a message with this head but
    for the tensors' bytes, which are holes of fixed lengths."""

    __slots__ = ("decoded", "fixed", "hits", "holes", "message", "size")

    def __init__(self, data: bytes, holes: list[Hole], message) -> None:
        self.size = len(data)
        self.holes = tuple(holes)
        fixed: list[tuple[int, bytes]] = []  # (where, the bytes there) between the holes
        at = 0
        for _, start, end in (*holes, (0, len(data), len(data))):
            if start > at:
                fixed.append((at, data[at:start]))
            at = end
        self.fixed = tuple(fixed)
        self.message = message  # the head parsed: shared by every message with this head, never changed
        self.hits = 0  # messages since the first that had this head
        # What a decoder made of this head for a model, for the next message with it (kserve.decode).
        self.decoded: object = None

    def match(self, data: bytes) -> dict[int, list[memoryview]] | None:
        """`data`'s tensor bytes as views when it is this head with other tensor bytes, else None.

        Same length, and the same bytes everywhere but in the holes: then protobuf would parse it to
        the head's message with the holes' bytes as its tensors (bytes fields take any bytes)."""
        if len(data) != self.size:
            return None
        for at, fixed in self.fixed:
            if not data.startswith(fixed, at):
                return None
        return _views(data, self.holes)


@dataclass(frozen=True, slots=True)
class Received(Generic[M]):
    """A request message, and the bytes of the fields cut out of it before it was parsed: by
    top-level field number, in the order they came. Empty when the message was parsed whole.

    `message` is read-only: when `repeat` is set it is its head's message, shared with other requests."""

    message: M
    views: Mapping[int, list[memoryview]] = field(default_factory=lambda: _NO_VIEWS)
    repeat: Repeat | None = None


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


# Where a tensor's bytes are in a message: (top-level field number, start, end), in the order they came.
Hole = tuple[int, int, int]


def _cut(data: bytes, fields: Fields) -> tuple[bytes, list[Hole]] | None:
    """The message `data` without the tensor bytes `fields` name, and where those bytes are; None
    where the scanner steps aside (the module's note says when)."""
    view = memoryview(data)
    kept: list[bytes | memoryview] = []
    holes: list[Hole] = []
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
                holes.append((number, value, end))
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
            holes.append((number, v, e))
            size = (end - value) - (e - s)
            kept += (view[at:start], varint(number << 3 | _LENGTH_DELIMITED), varint(size), view[value:s], view[e:end])
            at = end
    except _Unexpected:
        return None
    if not at:  # nothing cut (typed contents, say): the message as it came, not a copy of it
        return data, holes
    kept.append(view[at:])
    return b"".join(kept), holes


def _views(data: bytes, holes: list[Hole] | tuple[Hole, ...]) -> dict[int, list[memoryview]]:
    view = memoryview(data)
    views: dict[int, list[memoryview]] = {}
    for number, start, end in holes:
        entries = views.get(number)
        if entries is None:
            views[number] = [view[start:end]]
        else:
            entries.append(view[start:end])
    return views


def split(data: bytes, fields: Fields) -> tuple[bytes, dict[int, list[memoryview]]] | None:
    """The message `data` without the tensor bytes `fields` name, and those bytes as views of `data`;
    None where the scanner steps aside (the module's note says when)."""
    got = _cut(data, fields)
    if got is None:
        return None
    rest, holes = got
    return rest, _views(data, holes)


def parse(cls, data: bytes, fields: Fields) -> Received:
    """`data` as a message of protobuf class `cls`, its tensor bytes as views when it is large.
    Raises protobuf's DecodeError for bytes that are not such a message."""
    if len(data) >= LARGE_MESSAGE_BYTES:
        got = split(data, fields)
        if got is not None:
            rest, views = got
            return Received(cls.FromString(rest), views)
    return Received(cls.FromString(data))


class Parser(Generic[M]):
    """`parse` for one request type, with the heads it has seen remembered (the module's note):
    up to `capacity` heads, one per message length, the oldest forgotten first. Runs on one thread
    (the event loop's).

    Remembering a head costs a scan of the message in Python (~5 µs for a W1 request). Where heads do
    not repeat (a client that sends every request with its own id) that is all it costs, so after
    `capacity` heads in a row forgotten unused, the next `back_off` messages are parsed as `parse`
    does, and then it tries again."""

    def __init__(self, cls: type[M], fields: Fields, capacity: int = 64, back_off: int = 1024) -> None:
        self._cls = cls
        self._fields = fields
        self._capacity = capacity
        self._back_off = back_off
        self._by_size: dict[int, Repeat] = {}  # one head per message length: the latest
        self._unused = 0  # heads forgotten in a row without a repeat
        self._plain = 0  # messages still to parse without remembering their heads

    def __call__(self, data: bytes) -> Received[M]:
        """`data` as a message, like `parse`; raises protobuf's DecodeError for bytes that are not one."""
        repeat = self._by_size.get(len(data))
        if repeat is not None:
            views = repeat.match(data)
            if views is not None:
                repeat.hits += 1
                self._unused = 0
                return Received(repeat.message, views, repeat)
        if self._plain:
            self._plain -= 1
            return parse(self._cls, data, self._fields)
        got = _cut(data, self._fields)
        if got is None or not got[1]:  # left to protobuf, or no tensor bytes (typed contents): none kept
            return Received(self._cls.FromString(data))
        rest, holes = got
        repeat = Repeat(data, holes, self._cls.FromString(rest))
        forgotten = self._by_size.get(len(data))
        if forgotten is None and len(self._by_size) >= self._capacity:
            forgotten = self._by_size.pop(next(iter(self._by_size)))
        if forgotten is not None and not forgotten.hits:
            self._unused += 1
            if self._unused >= self._capacity:
                self._unused, self._plain = 0, self._back_off
        self._by_size[len(data)] = repeat
        views = repeat.match(data)
        assert views is not None  # the head and entries just found
        return Received(repeat.message, views, repeat)
