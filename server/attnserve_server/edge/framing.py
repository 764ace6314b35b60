"""Protobuf wire bytes of a response that carries tensors, with one copy of each tensor's bytes.

Set as a bytes field, an answer's bytes were copied into the message by upb, again when the message
was serialized (into a buffer that grows by doubling, so once more per doubling), and once more into
the bytes object gRPC sends. For a [256, 256] fp32 answer (256 KiB) upb's encoder took 14% of the
event loop's busy time (py-spy, BENCHMARKS.md, twelfth pass). A `Frame` keeps a response's small
fields serialized by protobuf and its tensors' bytes as references, and joins them once, when gRPC
serializes the response (`take`, in `registration.add_service`).

The wire format allows this: a message's fields may come in any order, a length-delimited field
(bytes, or a nested message) is its tag, its length and its bytes, and a repeated field's entries
are read in the order they come. So a frame parses to the very message protobuf would have built.
"""

from __future__ import annotations

from google.protobuf.message import Message

# What a part may be: anything b"".join takes (collections.abc.Buffer from Python 3.12).
Buffer = bytes | bytearray | memoryview
_LENGTH_DELIMITED = 2  # the wire type of bytes, strings and nested messages


def varint(value: int) -> bytes:
    """A non-negative integer in protobuf's base-128 varint encoding."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(number: int) -> bytes:
    return varint(number << 3 | _LENGTH_DELIMITED)


class Frame:
    """A message's wire bytes as parts: protobuf's serialization of its other fields first, then
    length-delimited fields appended by reference (bytes, or a nested frame)."""

    __slots__ = ("_parts", "size")

    def __init__(self, head: bytes = b"") -> None:
        self._parts: list[Buffer] = [head] if head else []
        self.size = len(head)  # the message's length on the wire

    def add_bytes(self, number: int, data: Buffer) -> Frame:
        """Appends field `number` (bytes, or one entry of repeated bytes) holding `data`, uncopied."""
        size = memoryview(data).nbytes
        prefix = _key(number) + varint(size)
        self._parts += (prefix, data)
        self.size += len(prefix) + size
        return self

    def add_message(self, number: int, inner: Frame) -> Frame:
        """Appends field `number`, a nested message, as `inner`'s parts (uncopied)."""
        prefix = _key(number) + varint(inner.size)
        self._parts.append(prefix)
        self._parts += inner._parts
        self.size += len(prefix) + inner.size
        return self

    def join(self) -> bytes:
        """The message's wire bytes: each part copied once."""
        return b"".join(self._parts)

    def take(self) -> bytes:
        """As `join`, and lets go of the parts: gRPC keeps the frame it is sending until its last byte
        has left, and a client slow to read would make the server hold each answer's tensors twice."""
        data = self.join()
        self._parts = []
        return data


def wire_size(response: Frame | Message) -> int:
    """A response's length on the wire: a frame's, or a protobuf message's."""
    return response.size if type(response) is Frame else response.ByteSize()  # type: ignore[union-attr]
