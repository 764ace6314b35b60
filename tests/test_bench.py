"""attnserve bench's closed loop on its own (a fake transport on a fake clock) and its summary of rounds;
no sockets, no torch."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from attnserve_bench.bench import StartLine, Window, _paired_cycle_s, _reap, closed_loop
from attnserve_bench.results import Row, medians


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


def _row(server: str, concurrency: int, rps: float, limit: float | None, batch: float, n: int) -> Row:
    return Row(
        server=server,
        concurrency=concurrency,
        requests=100 * n,
        errors=n - 1,
        throughput_rps=rps,
        p50_ms=float(n),
        p90_ms=2.0 * n,
        p99_ms=3.0 * n,
        mean_batch=batch,
        inprocess_rps=limit,
        inprocess_batch=None if limit is None else max(1, round(batch)),
        ratio=None if limit is None else rps / limit,
        error_samples=[f"e{n}"] if n > 1 else [],
        round=n,
    )


def test_rounds_summarise_as_medians_and_the_ratio_as_the_median_of_each_rounds_own() -> None:
    # Three rounds of one level on a machine whose speed drifts: the server and the limit slow together.
    rounds = [
        _row("s", 32, 60.0, 60.0, 16.2, 1),
        _row("s", 32, 30.0, 40.0, 15.6, 2),
        _row("s", 32, 50.0, 100.0, 16.4, 3),
    ]
    other = [_row("s", 1, 9.0, 10.0, 1.0, 1), _row("floor", 1, 500.0, None, 0.0, 1)]
    summary = medians([rounds[0], other[0], rounds[1], other[1], rounds[2]])
    assert [(r.server, r.concurrency, r.rounds) for r in summary] == [("s", 32, 3), ("s", 1, 1), ("floor", 1, 1)]
    (row,) = [r for r in summary if r.concurrency == 32]
    assert (row.throughput_rps, row.inprocess_rps, row.p50_ms, row.p99_ms, row.mean_batch) == (
        50.0,
        60.0,
        2.0,
        6.0,
        16.2,
    )
    # The rounds' own ratios are 1.0, 0.75 and 0.5: their median, not 50/60 (the medians' ratio).
    assert row.ratio == 0.75
    assert (row.requests, row.errors, row.error_samples, row.inprocess_batch) == (600, 3, ["e2", "e3"], 16)
    assert row.round is None
    # A level measured once stands as it was, and one with no limit keeps none.
    assert summary[1].ratio == 0.9 and summary[1].round is None and summary[1].rounds == 1
    assert summary[2].ratio is None and summary[2].inprocess_rps is None


class _Client:
    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive


def test_the_clients_start_together_once_every_one_is_ready() -> None:
    line = StartLine(mp.get_context("spawn"))
    starts: list[float] = []
    clients = [threading.Thread(target=lambda: starts.append(line.ready_and_wait())) for _ in range(2)]
    for c in clients:
        c.start()
    before = time.time()
    line.start_when_ready([_Client(True), _Client(True)], timeout_s=30)
    for c in clients:
        c.join()
    assert len(starts) == 2 and starts[0] == starts[1] >= before + StartLine.LEAD_S


def test_a_client_that_dies_before_it_is_ready_fails_the_start_instead_of_hanging() -> None:
    # One client was ready; the other died while importing. A short window must not be spent waiting.
    line = StartLine(mp.get_context("spawn"))
    line._ready.release()
    with pytest.raises(RuntimeError, match="died before the start"):
        line.start_when_ready([_Client(True), _Client(False)], timeout_s=30)


def test_a_client_whose_start_never_comes_gives_up_instead_of_hanging() -> None:
    line = StartLine(mp.get_context("spawn"))
    with pytest.raises(RuntimeError, match="no start within"):
        line.ready_and_wait(timeout_s=0.05)


def test_a_client_stuck_after_its_results_is_killed_and_the_measurement_kept(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ctx = mp.get_context("spawn")
    done, stuck = ctx.Process(target=time.sleep, args=(0,)), ctx.Process(target=time.sleep, args=(300,))
    for p in (done, stuck):
        p.start()
    _reap([done, stuck], grace_s=0.5)
    assert (done.exitcode, stuck.exitcode) == (0, -9)
    assert f"client process {stuck.pid} had not exited 0.5 s after its results: killed" in capsys.readouterr().err


def test_the_in_process_pairing_ends_both_runners_on_the_same_cycle() -> None:
    """`bench`'s in-process limit with pairing: the first runner decides the last cycle, and the second may
    look only once the first is already computing its next one. It must then still compute that cycle and
    meet the first, not leave it waiting at the barrier (bench hung 120 s so in CI; with no work to do, the
    first runner is always ahead)."""
    calls = {"shared": 0, "alone": 0}

    class Worker:  # two runners: this thread is the first, the executor's the second
        executor = ThreadPoolExecutor(1)

        def run_shared(self, batch: list[int]) -> None:
            calls["shared"] += 1

        def run(self, batch: list[int]) -> None:
            calls["alone"] += 1

    worker = Worker()
    try:
        for _ in range(50):
            calls.update(shared=0, alone=0)
            measured = threading.Thread(
                target=_paired_cycle_s, args=(worker, [[1, 2], [3, 4], [5, 6]], 0.0), daemon=True
            )
            measured.start()
            measured.join(10)
            assert not measured.is_alive(), "the first runner waits at the barrier for a second that has left"
            assert calls["shared"] == calls["alone"] >= 3 * 7  # every cycle, on both runners
    finally:
        Worker.executor.shutdown(wait=False)
