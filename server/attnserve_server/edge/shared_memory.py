"""Triton's system shared memory extension: regions of POSIX shared memory objects that a client on
the same host registers, so that its requests' tensors and answers cross through them instead of
through gRPC messages.

A region is a name for `byte_size` bytes at `offset` in the shared memory object `key` (as shm_open
names it: "/name", which Linux keeps as /dev/shm/name). The server opens the object once, at
registration, and reads and writes it with pread/pwrite on that descriptor, never through a mapping:
a client that shrinks or removes its object then makes a read come back short (the request is
refused, INVALID_ARGUMENT), never a SIGBUS that would take the server down. Each read copies the
tensor once, as gRPC's own receive would; no message is built around it.

With edge processes, a client's connections may reach different edges, so every edge holds the same
regions: an edge forwards a registration to the engine, which checks it, keeps the one table, and
sends it to every edge; only once every edge has it does the client get its answer.

Off unless the server runs with --allow-client-shm, as in Triton: a client that may register a
region makes the server read and write an object of its choosing, with the server's own rights, so
only clients on the same host, trusted as the server's user, should have it.
"""

from __future__ import annotations

import io
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from attnserve_server.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, QueueFull, clip

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory objects
DISABLED = "system shared memory is off on this server; start it with --allow-client-shm to use it"
# Regions registered at once, at most: each holds a file descriptor, and the process has a limited number.
MAX_REGIONS = 1024
# What a region is, as the engine sends its table to the edges: name -> (key, offset, byte_size).
Table = dict[str, tuple[str, int, int]]
# An edge's way to the engine: (operation, its arguments) -> done, or a ServingError raised.
Forward = Callable[[str, tuple], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Region:
    """A registered region. Its object stays open as long as anything holds the Region: a request
    decoded while the region was registered writes its answer there even if the client unregisters
    it meanwhile, and never to a descriptor closed and reused by another file."""

    name: str
    key: str
    offset: int
    byte_size: int
    file: io.FileIO  # closes its descriptor when the last holder lets go

    @property
    def fd(self) -> int:
        return self.file.fileno()


def object_path(key: str) -> str:
    """The file behind a shm_open key: "/name" (or "name") is /dev/shm/name."""
    name = key.lstrip("/")
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise InvalidArgument(
            f'key: expected a shared memory object\'s name as shm_open takes it ("/name"), got {clip(key)}'
        )
    return os.path.join(SHM_DIR, name)


class SharedMemoryRegistry:
    """The regions registered on this server, by name. Used on the event loop only."""

    def __init__(self, enabled: bool, forward: Forward | None = None, max_regions: int = MAX_REGIONS) -> None:
        self.enabled = enabled
        self.forward = forward  # in an edge process: registrations go through the engine
        self.max_regions = max_regions
        self._regions: dict[str, Region] = {}

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise FailedPrecondition(DISABLED)

    async def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """A client's SystemSharedMemoryRegister: here, or through the engine to every edge."""
        self._check_enabled()
        if self.forward is not None:
            await self.forward("register", (name, key, offset, byte_size))
        else:
            self.add(name, key, offset, byte_size)

    async def unregister(self, name: str) -> None:
        """A client's SystemSharedMemoryUnregister: `name` (a name not registered: nothing to do, as in
        Triton), or every region when `name` is empty."""
        self._check_enabled()
        if self.forward is not None:
            await self.forward("unregister", (name,))
        else:
            self.remove(name)

    def add(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Opens the object `key` and registers `name` for its bytes [offset, offset + byte_size)."""
        if not name:
            raise InvalidArgument("name: expected a region name, got an empty string")
        if name in self._regions:
            raise AlreadyExists(
                f"name: a shared memory region named {clip(name)} is already registered; unregister it first"
            )
        if byte_size <= 0:
            raise InvalidArgument(f"byte_size: expected a positive number of bytes, got {byte_size}")
        if len(self._regions) >= self.max_regions:
            raise QueueFull(
                f"name: {len(self._regions)} shared memory regions are registered, the most this server holds; "
                "unregister some first"
            )
        path = object_path(key)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise InvalidArgument(
                f"key: cannot open shared memory object {clip(key)} for reading and writing ({exc.strerror})"
            ) from None
        file = io.FileIO(fd, "r+", closefd=True)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidArgument(f"key: {clip(key)} is not a shared memory object")
            if offset + byte_size > info.st_size:
                raise InvalidArgument(
                    f"byte_size: offset {offset} + byte_size {byte_size} = {offset + byte_size} bytes, past the end "
                    f"of shared memory object {clip(key)} ({info.st_size} bytes)"
                )
        except BaseException:
            file.close()
            raise
        self._regions[name] = Region(name, key, offset, byte_size, file)

    def remove(self, name: str) -> None:
        names = list(self._regions) if not name else [name] if name in self._regions else []
        for n in names:
            del self._regions[n]  # its object closes once no request holds it

    def table(self) -> Table:
        """The regions as the engine sends them; safe to call from another thread (a scrape)."""
        return {r.name: (r.key, r.offset, r.byte_size) for r in list(self._regions.values())}

    def apply(self, table: Table) -> None:
        """Makes this edge's regions the engine's `table`: a region gone or changed is closed, a new one
        opened (one whose object vanished since the engine checked it is left out, and logged)."""
        for name, region in list(self._regions.items()):
            if table.get(name) != (region.key, region.offset, region.byte_size):
                del self._regions[name]
        for name, (key, offset, byte_size) in table.items():
            if name not in self._regions:
                try:
                    self.add(name, key, offset, byte_size)
                except InvalidArgument as exc:
                    log.warning("shared memory region %s left out: %s", clip(name), exc.message)

    def status(self, name: str) -> list[Region]:
        """Every region, or the one named (NOT_FOUND when it is not registered)."""
        self._check_enabled()
        if not name:
            return list(self._regions.values())
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"name: no shared memory region named {clip(name)} is registered")
        return [region]

    def close(self) -> None:
        self._regions.clear()

    def place(self, where: str, name: str, offset: int, byte_size: int) -> Region:
        """The region a tensor names, after checking that `byte_size` bytes at `offset` lie in it;
        `where` names the request's field in errors."""
        if not self.enabled:
            raise InvalidArgument(f"{where}: {DISABLED}")
        region = self._regions.get(name)
        if region is None:
            raise InvalidArgument(f"{where}: no shared memory region named {clip(name)} is registered")
        if offset < 0 or byte_size < 0 or offset + byte_size > region.byte_size:
            raise InvalidArgument(
                f"{where}: offset {offset} + byte_size {byte_size} lies outside shared memory region "
                f"{clip(name)} ({region.byte_size} bytes)"
            )
        return region

    @staticmethod
    def read(region: Region, offset: int, byte_size: int, where: str) -> bytes:
        """`byte_size` bytes at `offset` in `region` (checked by `place`)."""
        data = os.pread(region.fd, byte_size, region.offset + offset)
        if len(data) != byte_size:
            raise InvalidArgument(
                f"{where}: shared memory object {clip(region.key)} ends before the bytes of region "
                f"{clip(region.name)} do (it shrank since it was registered)"
            )
        return data

    @staticmethod
    def write(region: Region, offset: int, data: bytes | memoryview) -> None:
        """Writes `data` at `offset` in `region` (checked by `place`, with room for it)."""
        view = memoryview(data).cast("B")
        position = region.offset + offset
        while view:
            written = os.pwrite(region.fd, view, position)
            view, position = view[written:], position + written


# The registry of a server without --allow-client-shm: every call and every reference refused.
OFF = SharedMemoryRegistry(enabled=False)
