"""A request's large tensor bytes as views of the bytes gRPC received, not as copies.

Parsed by upb, a bytes field is copied twice: into the message while it parses, and into a new
bytes object each time it is read. For a 1 MiB request (WL: [256, 1024] fp32) those two copies cost
the event loop ~200 µs of its ~1.8 ms a request (BENCHMARKS.md, sixteenth pass), and the loop is
what an edge runs out of first. So a large message is first scanned at its top level: the tensor
fields are cut out and kept as memoryviews of the received bytes, and protobuf parses what remains,
a few hundred bytes of names, shapes and parameters.

The wire format allows this: a message is a sequence of fields (key, then a varint, 8 or 4 bytes,
or a length and that many bytes), in any order, and a message without some of its fields is still
a valid message. Anything this scanner does not expect (a field that repeats where protobuf would
merge it, a wire type that does not fit, bytes that end early) makes it step aside: protobuf parses
the whole message as before, and reports any error itself.

What no request can be is refused unparsed, as undecodable (`Refused`), whatever else the scan met
first: more fields than any request has (MAX_SCANNED_FIELDS), a tensor whose dtype and shape are
larger than a shape of millions of dimensions would need (MAX_TENSOR_HEAD_BYTES), a KServe input's
bool or integer contents past MAX_SLOW_BYTES, a group, an id past MAX_ID_CHARS. A server parses on its
event loop, so every other request waits while it does: the two million empty inputs of one 20 MB
message held it 4.7 s (read one by one), a 95 MB shape 17.8 s, where protobuf alone would take seconds.

Most request streams repeat one head: a client, a load generator, an application sends request after
request whose fields other than the tensor bytes (model, inputs' names, datatypes and shapes,
parameters) are the same bytes each time, and at most the request's id differs. A `Parser`
remembers the heads it has seen: a message whose bytes are a known head's everywhere but in its
tensors' bytes and its id is not parsed again. It gets the head's message (one object, shared by
every such request with the head's own id: read-only; a copy with its id otherwise) and its tensor
bytes as views, and the decoder may keep what it made of the head (`Repeat.decoded`) for the next
one. Under load at L=16 the loop spent ~12% of its GIL time decoding (py-spy, BENCHMARKS.md,
eighteenth pass).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Generic, TypeVar

from google.protobuf.message import DecodeError

from attnserve_server.edge.framing import varint
from attnserve_server.errors import size_text

M = TypeVar("M")
# Messages shorter than this parse whole: the scan's Python costs more than the copies it saves
# (a W1 request, 64 KiB: ~4 µs of copies).
LARGE_MESSAGE_BYTES = 256 << 10
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True, slots=True)
class Kept:
    """A nested message left in the head, whose field `large` may be large (KServe's typed contents in
    an input): its other fields are bounded as a tensor's are (MAX_TENSOR_HEAD_BYTES), and nothing cut.
    Within `large`, the fields `slow` (packed varints: protobuf parses them 12-27x slower a byte than
    floats) are bounded too, at MAX_SLOW_BYTES in all."""

    large: int
    slow: frozenset[int] = frozenset()


# Where a tensor's bytes are: a top-level field number -> None (the field itself holds them, as a
# repeated bytes field: KServe's raw_input_contents), or the number of the bytes field inside that
# nested message (attnserve.v1's Tensor.data inside AttendRequest.query), or Kept.
Fields = Mapping[int, int | Kept | None]
_NO_VIEWS: Mapping[int, list[memoryview]] = MappingProxyType({})  # shared: a small request allocates none
# Fields in one message (or one nested tensor message) past which it is refused unparsed: a request
# has a few dozen at most (a KServe request with every input, output and parameter: 29).
MAX_SCANNED_FIELDS = 256
# A nested tensor message's bytes besides its data (attnserve.v1's Tensor: dtype and up to 8 dims, at
# most 93 bytes; a KServe input: its name, datatype, shape and shared memory parameters), past which it
# is refused unparsed: protobuf alone took 3.7 s to parse a 190 MB shape of 200 million dimensions.
MAX_TENSOR_HEAD_BYTES = 16 << 10
# Packed varints (Kept.slow: KServe's bool and integer typed contents) in one input: a mask of 64
# sequences of 4096 keys takes 256 KiB; 4 MiB parse in ~40 ms, at 4-10 ns an element (256 MiB: 2.7 s).
MAX_SLOW_BYTES = 4 << 20


class Repeat:
    """A head seen before: the message it parses to, and the bytes of a message with this head but
    for the tensors' bytes, which are holes of fixed lengths, and its request id, which may be of any
    length (the bytes after it then lie that much further on)."""

    __slots__ = ("_after", "_id", "decoded", "fixed", "hits", "holes", "message", "size")

    def __init__(
        self, data: bytes, holes: list[Hole], message, request_id: tuple[str, int, int, int] | None = None
    ) -> None:
        self.size = len(data)
        self.holes = tuple(holes)
        # `request_id`: the id field's name, where its length starts, where its value starts and ends.
        # Its length and value are a hole of their own: (its name, where, where it ends, its value).
        self._id: tuple[str, int, int, bytes] | None = None
        cuts = sorted(holes, key=lambda hole: hole[1])
        if request_id is not None:
            name, at, value, end = request_id
            self._id = (name, at, end, data[value:end])
            cuts = sorted([*cuts, (0, at, end)], key=lambda hole: hole[1])
        fixed: list[tuple[int, bytes]] = []  # (where, the bytes there) between the holes
        at = 0
        for _, start, end in (*cuts, (0, len(data), len(data))):
            if start > at:
                fixed.append((at, data[at:start]))
            at = end
        self.fixed = tuple(fixed)
        # Where the parts that move with the id's length start: the first after it.
        self._after = (
            len(fixed)
            if self._id is None
            else next((i for i, (at, _) in enumerate(fixed) if at >= self._id[2]), len(fixed))
        )
        self.message = message  # the head parsed: shared by every message with this head, never changed
        self.hits = 0  # messages since the first that had this head
        # What a decoder made of this head for a model, for the next message with it (kserve.decode).
        self.decoded: object = None

    def match(self, data: bytes) -> tuple[object, dict[int, list[memoryview]]] | None:
        """`data`'s message and tensor bytes as views when it is this head with other tensor bytes
        (and another id), else None.

        The same bytes everywhere but in the holes, and a length that accounts for them: then
        protobuf would parse it to the head's message with the holes' bytes as its tensors (bytes
        fields take any bytes) and its own id, if that is UTF-8."""
        shift = 0
        request_id = self._id
        if request_id is not None:
            name, at, end, value = request_id
            try:
                length, start = _read_varint(data, at)
            except _Unexpected:
                return None
            shift = start + length - end
        if len(data) != self.size + shift:
            return None
        fixed, after = self.fixed, self._after
        for i in range(len(fixed)):
            at, part = fixed[i]
            if not data.startswith(part, at + shift if i >= after else at):
                return None
        message = self.message
        if request_id is not None:
            own = data[start : start + length]
            if own != value:
                try:
                    text = own.decode()
                except UnicodeDecodeError:
                    return None  # protobuf refuses it: parsed whole, it says so
                message = type(message)()
                message.CopyFrom(self.message)
                setattr(message, name, text)
            if shift:
                moved = request_id[2]
                holes = [(n, a + shift, b + shift) if a >= moved else (n, a, b) for n, a, b in self.holes]
                return message, _views(data, holes)
        return message, _views(data, self.holes)


@dataclass(frozen=True, slots=True)
class Received(Generic[M]):
    """A request message, and the bytes of the fields cut out of it before it was parsed: by
    top-level field number, in the order they came. Empty when the message was parsed whole.

    `message` is read-only: when `repeat` is set it may be its head's message, shared with other
    requests (payload.Parser)."""

    message: M
    views: Mapping[int, list[memoryview]] = field(default_factory=lambda: _NO_VIEWS)
    repeat: Repeat | None = None


class _Unexpected(Exception):
    """Bytes the scanner leaves to protobuf."""


class Refused(DecodeError):
    """A message no request could be (the module's note says which): refused unparsed, as protobuf
    refuses bytes it cannot parse.
    `number`: the top-level field at fault, named once the message's type is known (`named`)."""

    def __init__(self, text: str, number: int | None = None) -> None:
        super().__init__(text)
        self.text, self.number, self.field = text, number, None if number is None else f"field {number}"

    def named(self, cls) -> Refused:
        """This refusal with its field's name in `cls`, the message's type."""
        by_number = cls.DESCRIPTOR.fields_by_number  # type: ignore[attr-defined]
        if self.number in by_number:
            self.field = by_number[self.number].name
        return self

    def __str__(self) -> str:
        return self.text if self.field is None else f"{self.field}: {self.text}"


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
    field of the message in data[start:end]; a length-delimited value starts after its length.
    Raises Refused past MAX_SCANNED_FIELDS."""
    pos = start
    left = MAX_SCANNED_FIELDS
    while pos < end:
        left -= 1
        if left < 0:
            raise Refused(f"more than {MAX_SCANNED_FIELDS} fields in one message; a request has at most a few dozen")
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
        else:  # groups: deprecated, and in no request (proto3 has none)
            raise Refused(f"a group (wire type {wire}); no request has one", number)
        if pos > end or number == 0:
            raise _Unexpected
        yield number, wire, at, value, pos


# Where a tensor's bytes are in a message: (top-level field number, start, end), in the order they came.
Hole = tuple[int, int, int]


def _large_field(
    data: bytes, number: int, start: int, end: int, large: int
) -> tuple[tuple[int, int, int] | None, bool]:
    """Field `large` of the nested message in data[start:end] (top-level field `number`): (where it
    starts, its value, its end) or None; and whether it came more than once, or not as bytes (protobuf
    then decides). Raises Refused where the message's other fields pass MAX_TENSOR_HEAD_BYTES."""
    found = None
    odd = False
    for n, w, s, v, e in _fields(data, start, end):
        if n == large:
            odd = odd or w != _LENGTH_DELIMITED or found is not None
            found = (s, v, e)
    size = (end - start) - (0 if found is None else found[2] - found[0])
    if size > MAX_TENSOR_HEAD_BYTES:
        raise Refused(
            f"a tensor with {size_text(size)} besides its data, where its name, dtype and shape take a few"
            f" hundred bytes (at most {size_text(MAX_TENSOR_HEAD_BYTES)})",
            number,
        )
    return found, odd


def _bound_slow(data: bytes, number: int, start: int, end: int, slow: frozenset[int]) -> None:
    """Raises Refused where the fields `slow` of the message in data[start:end] pass MAX_SLOW_BYTES."""
    size = sum(e - s for n, _, s, _, e in _fields(data, start, end) if n in slow)
    if size > MAX_SLOW_BYTES:
        raise Refused(
            f"{size_text(size)} of typed bool or integer contents, where an input takes at most"
            f" {size_text(MAX_SLOW_BYTES)} of them; send large inputs in raw_input_contents",
            number,
        )


def _cut(
    data: bytes, fields: Fields, request_id: int | None = None
) -> tuple[bytes, list[Hole], tuple[int, int, int] | None] | None:
    """The message `data` without the tensor bytes `fields` name, where those bytes are, and where
    field `request_id` has its length and its value (start, end) when it comes once; None where the
    scanner steps aside (the module's note says when)."""
    view = memoryview(data)
    kept: list[bytes | memoryview] = []
    holes: list[Hole] = []
    ids: list[Hole] = []
    nested_seen: set[int] = set()
    aside = False  # the scan steps aside, once it has checked the rest for what it refuses
    at = 0  # data[at:] not yet kept or cut
    try:
        for number, wire, start, value, end in _fields(data, 0, len(data)):
            if number == request_id and wire == _LENGTH_DELIMITED:
                ids.append((_read_varint(data, start)[1], value, end))  # where its length starts, its value
            if number not in fields:
                continue
            if wire != _LENGTH_DELIMITED:
                aside = True
                continue
            inner = fields[number]
            if type(inner) is Kept:
                found, _ = _large_field(data, number, value, end, inner.large)
                if found is not None and inner.slow:
                    _bound_slow(data, number, found[1], found[2], inner.slow)
                continue
            if inner is None:  # a repeated bytes field: cut the whole field out
                holes.append((number, value, end))
                kept.append(view[at:start])
                at = end
                continue
            if number in nested_seen:  # a nested message sent twice: protobuf merges the two
                aside = True
            nested_seen.add(number)
            found, twice = _large_field(data, number, value, end, inner)
            aside = aside or twice
            if found is None or aside:
                continue
            s, v, e = found
            holes.append((number, v, e))
            size = (end - value) - (e - s)
            kept += (view[at:start], varint(number << 3 | _LENGTH_DELIMITED), varint(size), view[value:s], view[e:end])
            at = end
    except _Unexpected:
        return None
    if aside:
        return None
    found = ids[0] if len(ids) == 1 else None  # twice: protobuf keeps the last; not a hole then
    if not at:  # nothing cut (typed contents, say): the message as it came, not a copy of it
        return data, holes, found
    kept.append(view[at:])
    return b"".join(kept), holes, found


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
    rest, holes, _ = got
    return rest, _views(data, holes)


def parse(cls, data: bytes, fields: Fields) -> Received:
    """`data` as a message of protobuf class `cls`, its tensor bytes as views when it is large.
    Raises protobuf's DecodeError for bytes that are not such a message."""
    if len(data) >= LARGE_MESSAGE_BYTES:
        try:
            got = split(data, fields)
        except Refused as exc:
            raise exc.named(cls) from None
        if got is not None:
            rest, views = got
            return Received(cls.FromString(rest), views)
    return Received(cls.FromString(data))


_WITH_IDS = 4  # heads with an id a Parser tries whatever the message's length
# Heads of one message length a Parser keeps. One head can come in several byte orders: a map's entries
# (KServe's parameters) serialize in the order of the sender's map, which C++ and Go protobuf do not fix,
# so perf_analyzer's two parameters (`causal` and its own triton_enable_empty_final_response) came in
# either order from one request to the next, and one head a length missed every other request.
HEADS_PER_LENGTH = 8
# The most a remembered head may hold (its bytes and its message): a request's names, shapes and
# parameters take a few hundred; a larger one (typed contents beside a raw entry, unknown fields) is
# parsed as `parse` does and not kept, so `capacity` heads cannot pin `capacity` large messages.
MAX_HEAD_BYTES = 16 << 10
# The longest request id accepted. Every answer echoes its request's id, which its size (as the server
# owes it, edge/outbox.py, and as it must fit max_message_bytes) does not count beyond a few KiB: a
# client that sent eight requests with ids of 100 MiB and read no answers held the server at 3.9 GiB,
# counted as 160 KiB owed.
MAX_ID_CHARS = 16 << 10


class Parser(Generic[M]):
    """`parse` for one request type, with the heads it has seen remembered (the module's note):
    up to `capacity` heads, at most HEADS_PER_LENGTH of one message length, the oldest forgotten
    first. Runs on one thread (the event loop's).

    Remembering a head costs a scan of the message in Python (~5 µs for a W1 request). Where heads do
    not repeat (every request of another shape, say) that is all it costs, so after
    `capacity` heads in a row forgotten unused, the next `back_off` messages are parsed as `parse`
    does, and then it tries again."""

    def __init__(
        self, cls: type[M], fields: Fields, request_id: str | None = None, capacity: int = 64, back_off: int = 1024
    ) -> None:
        self._cls = cls
        self._fields = fields
        # A top-level string field each request may set to its own value: an id of up to MAX_ID_CHARS.
        self._request_id_name = request_id
        self._request_id = None if request_id is None else cls.DESCRIPTOR.fields_by_name[request_id].number  # type: ignore[attr-defined]
        self._capacity = capacity
        self._back_off = back_off
        self._heads: dict[Repeat, None] = {}  # every head kept, oldest first (each knows its message's length)
        self._by_size: dict[int, list[Repeat]] = {}  # the heads kept by message length, latest first
        self._with_ids: list[Repeat] = []  # heads with an id, latest first: tried when an id's length differs
        self._unused = 0  # heads forgotten in a row without a repeat
        self._plain = 0  # messages still to parse without remembering their heads

    def __call__(self, data: bytes) -> Received[M]:
        """`data` as a message, like `parse`; raises protobuf's DecodeError for bytes that are not one,
        and Refused for an id longer than MAX_ID_CHARS."""
        received = self._read(data)
        name = self._request_id_name
        if name is not None and len(data) > MAX_ID_CHARS and len(getattr(received.message, name)) > MAX_ID_CHARS:
            count = len(getattr(received.message, name))
            raise Refused(
                f"an id of {count:,} characters, where one takes at most {MAX_ID_CHARS:,}", self._request_id
            ).named(self._cls)
        return received

    def _read(self, data: bytes) -> Received[M]:
        sized = self._by_size.get(len(data), ())
        got = repeat = None
        for repeat in sized:
            if (got := repeat.match(data)) is not None:
                break
        if got is None:
            for repeat in self._with_ids:  # the heads of this length, with an id or not, were tried above
                if repeat not in sized and (got := repeat.match(data)) is not None:
                    break
        if got is not None:
            repeat.hits += 1  # type: ignore[union-attr]
            self._unused = 0
            return Received(got[0], got[1], repeat)  # type: ignore[arg-type]
        if self._plain:
            self._plain -= 1
            return parse(self._cls, data, self._fields)
        try:
            cut = _cut(data, self._fields, self._request_id)
        except Refused as exc:
            raise exc.named(self._cls) from None
        if cut is None or not cut[1]:  # left to protobuf, or no tensor bytes (typed contents): none kept
            return Received(self._cls.FromString(data))
        rest, holes, request_id = cut
        if len(rest) > MAX_HEAD_BYTES:
            return Received(self._cls.FromString(rest), _views(data, holes))
        named = None if request_id is None else (self._request_id_name, *request_id)
        repeat = Repeat(data, holes, self._cls.FromString(rest), named)  # type: ignore[arg-type]
        self._keep(repeat)
        if request_id is not None:
            self._with_ids = [repeat, *self._with_ids[: _WITH_IDS - 1]]
        return Received(repeat.message, _views(data, holes), repeat)

    def _keep(self, repeat: Repeat) -> None:
        """Keeps a new head, forgetting the oldest of its message length or of all."""
        sized = self._by_size.get(repeat.size, ())
        forgotten = None
        if len(sized) >= HEADS_PER_LENGTH:
            forgotten = sized[-1]
        elif len(self._heads) >= self._capacity:
            forgotten = next(iter(self._heads))
        if forgotten is not None:
            del self._heads[forgotten]
            kept = self._by_size[forgotten.size]
            kept.remove(forgotten)
            if not kept:
                del self._by_size[forgotten.size]
            if not forgotten.hits:
                self._unused += 1
                if self._unused >= self._capacity:
                    self._unused, self._plain = 0, self._back_off
        self._by_size.setdefault(repeat.size, []).insert(0, repeat)
        self._heads[repeat] = None
