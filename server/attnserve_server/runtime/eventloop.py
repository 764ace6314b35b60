"""Which asyncio event loop a server process runs on: uvloop when installed (the server extra
brings it), else asyncio's own. Measured on W1 (BENCHMARKS.md): uvloop serves 2-10% more requests
per second for the same CPU. gRPC's asyncio stack runs on either."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from attnserve_server.errors import ConfigError

CHOICES = ("auto", "uvloop", "asyncio")


def loop_factory(choice: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """(the loop's name, a factory for it) for `event_loop`: auto takes uvloop if it imports."""
    if choice not in CHOICES:
        raise ConfigError(f"event_loop: expected one of {CHOICES}, got {choice!r}")
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ConfigError("event_loop: uvloop is not installed (pip install uvloop)") from None
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop
