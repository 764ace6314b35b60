"""grpc.health.v1 for an asyncio server: Check, and Watch streams that no client can hold up.

grpc_health's own asyncio servicer writes each watcher's update while holding the lock its `set` needs.
So one watcher whose client did not read (HTTP/2 flow control) held every status change of its service
until its connection died: a SIGTERM's NOT_SERVING included, and with it the whole stop (55 s, until
the client's connection timed out), while every other watcher heard nothing. And the first watcher of
a service to end removed the service's condition, so the others were never told of a change again.

Here a status change is a dictionary write and an `Event.set` per watcher, and never waits: each Watch
stream writes on its own task, the latest status only (a status that changes twice while a client reads
slowly reaches it once, as the protocol allows: a watcher wants the eventual status).
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attnserve_server.errors import clip

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):
    """The statuses of the server ("") and of each service or model by name (module note)."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {"": SERVING}
        self._watchers: dict[str, set[asyncio.Event]] = {}  # service -> one event per open Watch stream
        self._shutting_down = False

    async def set(self, service: str, status: int) -> None:
        """Sets a service's status and tells its watchers; ignored once the server is shutting down.
        Never waits (a coroutine for the callers of grpc_health's servicer, whose `set` is one)."""
        if not self._shutting_down:
            self._set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good: later `set` calls are ignored."""
        self._shutting_down = True
        for service in list(self._status):
            self._set(service, NOT_SERVING)

    def _set(self, service: str, status: int) -> None:
        self._status[service] = status
        for changed in self._watchers.get(service, ()):
            changed.set()

    async def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"the server has no health status named {clip(request.service)}"
            )
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        """The service's status now (SERVICE_UNKNOWN for a name not known), then each change, until the
        client leaves or the server stops."""
        service = request.service
        changed = asyncio.Event()
        watchers = self._watchers.setdefault(service, set())
        watchers.add(changed)
        try:
            sent = None
            while True:
                changed.clear()  # before reading: a change while the write waits is not lost
                status = self._status.get(service, SERVICE_UNKNOWN)
                if status != sent:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    sent = status
                await changed.wait()
        finally:
            watchers.discard(changed)
            if not watchers and self._watchers.get(service) is watchers:
                del self._watchers[service]
