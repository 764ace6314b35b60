"""What an engine and its edge processes share: the message channel, the payload arena, the codes.

Per edge, the engine makes a socket pair for messages, a second one for metrics snapshots and a
memfd for payloads, and passes them, with the admission board's memfd, to the edge process it
starts. Messages are small pickled tuples (descriptors, never tensor payloads); tensors cross
through the arena, which both processes map: the edge allocates a region per request, writes the
request's tensors there and leaves room for its answer; the engine reads the tensors in place and
writes the answer into that room.

A request's messages (SUBMIT, DONE) hold plain tuples, not NamedTuples or dataclasses: pickle writes
those with their class's name, which the receiver looks up again for every message. A DONE that
held a BatchReport took 4.2 µs to pickle and 4.6 to read back on this project's 2-vCPU VMs, as a
plain tuple 0.4 and 0.5 (BENCHMARKS.md, forty-fourth pass): several µs a request on each side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import operator
import os
import pickle
import struct
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from attnserve_server.domain import ANSWER_ALIGN, BatchReport, aligned

# edge -> engine
READY = 1  # (READY,): the edge serves its port
FATAL = 2  # (FATAL, error class name, message): the edge cannot start
SUBMIT = 3  # (SUBMIT, id, model, a Submission's fields as a tuple): see edge_process.EngineLink.submit
CANCEL = 4  # (CANCEL, id): its caller went away
STATS = 5  # (STATS, id, model names): KServe statistics, summed over every process
SHM = 6  # (SHM, id, "register" or "unregister", arguments): a client's shared memory call (shared_memory.py)
SHM_ACK = 7  # (SHM_ACK, version): the edge holds that version of the regions' table
# engine -> edge
HELLO = 10  # (HELLO, settings, [ModelInfo], port)
DONE = 11  # (DONE, id, output TensorRef, weights TensorRef or None, report_fields(BatchReport))
FAILED = 12  # (FAILED, id, status code name, message)
CANCELLED = 13  # (CANCELLED, id): dropped as asked; its region is free
STATS_REPLY = 14  # (STATS_REPLY, id, {model: InferenceStats})
STATE = 15  # (STATE, {model: ready}, serving): readiness and health
STOP = 16  # (STOP, seconds left of the grace period): stop serving and exit (EXIT_GRACE_RAN_OUT, or 0)
SHM_TABLE = 17  # (SHM_TABLE, version, {region name: (key, offset, byte_size)}): every edge's regions now
SHM_REPLY = 18  # (SHM_REPLY, id, None, or (status name, message)): the SHM call's outcome

# An edge's exit status when it stopped as asked, but the grace period ran out before every call it had
# taken ended and every answer went out (front.GrpcFront.stop).
EXIT_GRACE_RAN_OUT = 3

_HEADER = struct.Struct("<I")
ALIGN = ANSWER_ALIGN  # regions and the tensors in them start at multiples of this
# Answers of at least this many bytes are written into their region by the worker and read there by
# the edge, uncopied (AnswerRoom); smaller ones are copied, which costs less than the bookkeeping (a
# room and its lock, a finalizer): with 512-byte answers the rooms cost the engine's lane ~9 µs a
# request and served 5% fewer, with 1 MiB ones they saved the engine's loop ~140 µs and the edges ~200
# (BENCHMARKS.md, forty-third pass).
IN_PLACE_BYTES = 64 << 10


class Channel(asyncio.Protocol):
    """Length-prefixed pickled messages over a stream socket. Messages sent in one turn of the
    event loop leave in one write; each message received is handed to `on_message` at once."""

    def __init__(self, on_message: Callable[[tuple], None], on_lost: Callable[[], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._in = bytearray()
        self._out: list[bytes] = []
        self._flushing = False
        self._transport: asyncio.Transport | None = None
        # made on its loop (connect); asyncio.get_running_loop costs a getpid() in Python 3.11, per message
        self._loop = asyncio.get_running_loop()

    @classmethod
    async def connect(cls, sock, on_message: Callable[[tuple], None], on_lost: Callable[[], None]) -> Channel:
        loop = asyncio.get_running_loop()
        _, channel = await loop.connect_accepted_socket(lambda: cls(on_message, on_lost), sock)
        return channel

    def connection_made(self, transport) -> None:
        self._transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._on_lost()

    def data_received(self, data: bytes) -> None:
        buf = self._in
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= 4:
            (size,) = _HEADER.unpack_from(buf, pos)
            if end - pos - 4 < size:
                break
            message = pickle.loads(buf[pos + 4 : pos + 4 + size])
            pos += 4 + size
            self._on_message(message)
        del buf[:pos]

    def send(self, message: tuple) -> None:
        if self._transport is None:
            return  # the peer is gone; on_lost has run or will
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._out += (_HEADER.pack(len(data)), data)
        if not self._flushing:
            self._flushing = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        if self._transport is not None and self._out:
            self._transport.write(b"".join(self._out))
        self._out.clear()

    def close(self) -> None:
        self._flush()
        if self._transport is not None:
            self._transport.close()


def send_blocking(sock, payload: Any) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive_blocking(sock) -> Any:
    """One message from a blocking socket; EOFError if the peer closed it."""
    (size,) = _HEADER.unpack(_read_exactly(sock, 4))
    return pickle.loads(_read_exactly(sock, size))


def _read_exactly(sock, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise EOFError("the peer closed the socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class Arena:
    """A shared-memory region both processes map (a memfd: nothing to clean up after a crash)."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(fd, size)
        self.view = memoryview(self._map)

    @staticmethod
    def create(size: int, name: str) -> int:
        """A new memfd of `size` bytes (its pages are taken as they are first written)."""
        fd = os.memfd_create(name, 0)  # no MFD_CLOEXEC: the edge process inherits it
        os.ftruncate(fd, size)
        return fd


class Board:
    """Each model's queue as the engine's batcher last reported it, in shared memory: the engine
    writes, every edge reads, no message either way. An edge refuses a request before decoding it
    when the queue is full or draining, as a single process would (the engine checks again)."""

    FIELDS = 3  # depth, queued bytes, closing

    def __init__(self, fd: int, models: int) -> None:
        self._map = mmap.mmap(fd, self.bytes_for(models))
        self._cells = memoryview(self._map).cast("q")

    @classmethod
    def bytes_for(cls, models: int) -> int:
        return max(mmap.PAGESIZE, 8 * cls.FIELDS * models)

    def write(self, index: int, depth: int, queued_bytes: int, closing: bool) -> None:
        at = index * self.FIELDS
        cells = self._cells
        cells[at], cells[at + 1], cells[at + 2] = depth, queued_bytes, int(closing)

    def read(self, index: int) -> tuple[int, int, bool]:
        at = index * self.FIELDS
        cells = self._cells
        return cells[at], cells[at + 1], bool(cells[at + 2])


class Ring:
    """Regions of an arena, taken in order around a ring and freed in any order: requests mostly
    finish in the order they came, so the space behind the oldest live region comes back at once.
    Used by the edge only (one thread)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._live: deque[list] = deque()  # [start, end, freed], oldest first
        self._by_start: dict[int, list] = {}
        self._head = 0  # where the next region starts

    def take(self, n: int) -> int | None:
        """The start of a free region of `n` bytes, or None when none is free now."""
        n = max(ALIGN, aligned(n))
        if not self._live:
            self._head = 0
            start = 0 if n <= self.size else None
        else:
            tail = self._live[0][0]
            if self._live[-1][0] >= tail:  # not wrapped: free are [head, size) and [0, tail)
                start = self._head if self.size - self._head >= n else (0 if tail >= n else None)
            else:  # wrapped: free is [head, tail)
                start = self._head if tail - self._head >= n else None
        if start is None:
            return None
        region = [start, start + n, False]
        self._live.append(region)
        self._by_start[start] = region
        self._head = start + n
        return start

    def free(self, start: int) -> None:
        self._by_start.pop(start)[2] = True
        live = self._live
        while live and live[0][2]:
            live.popleft()


# A tensor in a message: (the arena offset of its bytes, or the bytes themselves, nbytes, shape).
TensorRef = tuple


class Submission(NamedTuple):
    """A request as it crosses to the engine: AttentionRequest's fields, its tensors as references."""

    query: TensorRef
    key: TensorRef | None
    value: TensorRef | None  # None with key set: the key is the value too (key_value)
    key_padding: np.ndarray | None
    causal: bool
    need_weights: bool
    average_weights: bool
    unbatched: bool
    nbytes: int
    memory_bytes: int
    answer_at: int  # the arena offset the answer goes to; -1: send it back in the message
    answer_room: int  # bytes there
    trace: tuple[int, int, int] | None  # the request span's (trace id, span id, flags)
    deadline: float | None  # on the monotonic clock both processes share
    expire: bool


# A BatchReport as a DONE message carries it: its fields in order (`BatchReport(*fields)` rebuilds it).
report_fields: Callable[[BatchReport], tuple] = operator.attrgetter(*(f.name for f in dataclasses.fields(BatchReport)))
