"""attnserve bench's closed loop on its own: a fake transport on a fake clock; no sockets, no torch."""

from __future__ import annotations

import asyncio

import pytest
from attnserve_bench.bench import Window, closed_loop


class Clock:
    """Time that passes only when a fake call says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Failed(Exception):
    def code(self):  # as grpc.aio.AioRpcError answers
        return type("Code", (), {"name": "UNAVAILABLE"})

    def details(self) -> str:
        return "gone"


def _run(send, window: Window, clock: Clock) -> None:
    counted: list[None] = []
    asyncio.run(closed_loop(send, [b"a"], 0, window, Failed, lambda: counted.append(None), clock))
    assert len(counted) == len(window.latencies)  # the progress bar counts what the window counts


def test_the_window_counts_every_answer_that_arrives_in_it_as_perf_analyzer_does() -> None:
    clock = Clock()
    sent: list[float] = []

    async def send(request: bytes) -> int:
        sent.append(clock.now)
        clock.now += 0.3  # each answer takes 0.3 s
        return 4

    window = Window(1.0, 3.0)
    _run(send, window, clock)
    # Answers at 0.3, 0.6, ... 3.0, 3.3: seven arrive in [1.0, 3.0], the first sent at 0.9, before the
    # window opened. Counting only requests sent inside it would find six: 1/7 of the throughput lost.
    assert len(window.latencies) == 7
    assert window.latencies == pytest.approx([0.3] * 7)
    assert window.batches == [4] * 7
    # The slot stops sending once the window has closed, and sent nothing after it.
    assert max(sent) < window.end and sent[-1] == pytest.approx(3.0)


def test_failures_count_by_when_they_arrive_and_the_slot_goes_on() -> None:
    clock = Clock()
    calls = 0

    async def send(request: bytes) -> int:
        nonlocal calls
        calls += 1
        clock.now += 0.5
        if calls % 2 == 0:
            raise Failed()
        return 1

    window = Window(0.75, 3.0)
    _run(send, window, clock)
    # Calls end at 0.5 (before the window), 1.0 (failed: sent at 0.5, before the window opened, and
    # counted all the same), 1.5, 2.0 (failed), 2.5 and 3.0 (failed: the window's end counts).
    assert window.errors == ["UNAVAILABLE: gone"] * 3
    assert len(window.latencies) == 2
    assert calls == 6


def test_each_slot_takes_the_requests_in_turn_from_its_own() -> None:
    clock = Clock()
    seen: list[bytes] = []

    async def send(request: bytes) -> int:
        seen.append(request)
        clock.now += 1.0
        return 1

    asyncio.run(closed_loop(send, [b"64", b"128", b"256"], 1, Window(0.0, 4.0), Failed, clock=clock))
    assert seen == [b"128", b"256", b"64", b"128"]
