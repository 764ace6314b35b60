"""The batcher on its own: fake runners on threads of their own, gated by threading.Event; no sockets, no torch."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

from attnserve_server import batching
from attnserve_server.batching import Batcher, BatchLimits
from attnserve_server.errors import (
    BatcherStopped,
    BatchFailed,
    DeadlineExpired,
    QueueFull,
    ServingError,
    ShuttingDown,
    WorkerLost,
)

WAIT_S = 5.0  # how long a test waits for something that must happen


class FakeRunner:
    """Records each batch; each run, on the runner's thread, waits until the test opens the gate."""

    def __init__(self, fail_on: object = None) -> None:
        self.batches: list[list[object]] = []
        self.gate = threading.Event()
        self.running = threading.Event()
        self.fail_on = fail_on

    def __call__(self, items: list[object]) -> list[object]:
        self.batches.append(list(items))
        self.running.set()
        assert self.gate.wait(WAIT_S * 4), "the test never opened the gate"
        if self.fail_on in items:
            raise RuntimeError("boom")
        return [("done", item) for item in items]

    async def started(self) -> None:
        await until(self.running.is_set)


class Recorder:
    def __init__(self) -> None:
        self.drops: Counter[str] = Counter()
        self.depths: list[int] = []
        self.batches: list[int] = []

    def queue_depth(self, depth: int) -> None:
        self.depths.append(depth)

    def dropped(self, reason: str) -> None:
        self.drops[reason] += 1

    def batch_started(self, requests: int, queue_waits_s: list[float]) -> None:
        assert len(queue_waits_s) == requests and all(w >= 0 for w in queue_waits_s)
        self.batches.append(requests)


def limits(**kw: float) -> BatchLimits:
    base = {"max_batch_size": 8, "max_batch_tokens": 10_000, "max_queue_delay_s": 0.0, "max_queue_size": 100}
    base.update(kw)
    return BatchLimits(**base)  # type: ignore[arg-type]


async def until(condition, timeout_s: float = WAIT_S) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), timeout_s)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def start(b: Batcher, *runners) -> list[threading.Thread]:
    """Starts the batcher on the running loop and each runner serving it on a thread of its own."""
    b.start()
    threads = [threading.Thread(target=b.serve, args=(r,), daemon=True) for r in runners]
    for t in threads:
        t.start()
    return threads


async def stop(b: Batcher, threads: list[threading.Thread]) -> None:
    """Closes the batcher and checks that every runner's thread returned."""
    await b.close()
    for t in threads:
        await asyncio.to_thread(t.join, WAIT_S)
        assert not t.is_alive(), "a runner kept serving a closed batcher"


def submit(b: Batcher, item: object, sequences: int = 1, length: int = 1, group: object = "g", deadline=None, **kw):
    return asyncio.ensure_future(
        b.submit(item, sequences=sequences, length=length, group=group, deadline=deadline, **kw)
    )


async def occupy(b: Batcher, runner: FakeRunner) -> tuple[asyncio.Future, list[threading.Thread]]:
    """Starts the batcher and keeps its runner busy with "block" until the test opens the gate."""
    threads = start(b, runner)
    blocker = submit(b, "block")
    await runner.started()
    return blocker, threads


def test_requests_queue_while_the_runner_is_busy_and_then_run_as_one_batch() -> None:
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher(limits())
        threads = start(b, runner)
        first = submit(b, "a")
        await runner.started()
        rest = [submit(b, x) for x in "bcd"]
        await until(lambda: b.depth == 3)
        runner.gate.set()
        results = await asyncio.gather(first, *rest)
        assert runner.batches == [["a"], ["b", "c", "d"]]
        assert results == [("done", x) for x in "abcd"]  # each caller gets the runner's own result
        await stop(b, threads)

    run(main())


def test_pipelining_takes_half_the_requests_in_play_so_two_groups_alternate() -> None:
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher(limits(pipeline=True))
        blocker, threads = await occupy(b, runner)  # one request in the worker: taken alone
        rest = [submit(b, x) for x in "abcdefg"]
        await until(lambda: b.depth == 7)
        runner.gate.set()
        await asyncio.gather(blocker, *rest)
        # in play after the blocker: itself and seven waiting, so four; then four and three, so three
        assert runner.batches == [["block"], ["a", "b", "c", "d"], ["e", "f", "g"]]
        await stop(b, threads)

    run(main())


@pytest.mark.parametrize(
    ("work", "expected"),
    [
        # 10 a request, bound 25: the third reaches it; the fourth sequence is the floor, so four.
        (10, [["block"], ["a", "b", "c", "d"], ["e", "f", "g", "h"], ["i", "j"]]),
        # 1 a request never reaches it: the pipelining cap alone (half of those in play).
        (1, [["block"], ["a", "b", "c", "d", "e"], ["f", "g", "h", "i", "j"]]),
    ],
)
def test_pipelining_closes_a_batch_of_enough_work_once_it_holds_four_sequences(
    work: int, expected: list[list[str]]
) -> None:
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher(limits(pipeline=True, pipeline_work=25, max_batch_size=64))
        blocker, threads = await occupy(b, runner)
        rest = [submit(b, x, work=work) for x in "abcdefghij"]
        await until(lambda: b.depth == 10)
        runner.gate.set()
        await asyncio.gather(blocker, *rest)
        assert runner.batches == expected
        await stop(b, threads)

    run(main())


def test_pipelining_leaves_the_batches_of_a_model_with_a_delay_whole() -> None:
    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        # A delay asks for full batches: six close one batch at max_batch_size, not half of them (the
        # pipelining cap), nor four (the work bound, reached at the floor of four sequences).
        b = Batcher(limits(pipeline=True, pipeline_work=1, max_batch_size=6, max_queue_delay_s=30.0))
        threads = start(b, runner)
        await asyncio.gather(*[submit(b, x, work=5) for x in "abcdef"])
        assert runner.batches == [list("abcdef")]
        await stop(b, threads)

    run(main())


async def arrives_while_busy(
    b: Batcher, runner: FakeRunner, work: int, in_play: int = 0
) -> tuple[asyncio.Future, asyncio.Future, list]:
    """Request "a" (of `work`) arrives while the runner computes "block"; then the runner is let go. Returns
    "a"'s and the blocker's futures, and the runner's threads. With `in_play`, first as many requests are in
    at once (one computing, the rest queued), as clients that keep that many in play send them: a lingering
    batch may then wait for that many (batching.py: lingering)."""
    if in_play:
        threads = start(b, runner)
        seen = [submit(b, ("seen", 0), work=1 << 40)]  # too much work to linger
        await runner.started()
        seen += [submit(b, ("seen", i), work=1 << 40) for i in range(1, in_play)]
        await until(lambda: b.depth == in_play - 1)
        runner.gate.set()
        await asyncio.gather(*seen)
        runner.gate.clear()
        runner.running.clear()
        runner.batches.clear()
        blocker = submit(b, "block")
        await runner.started()
    else:
        blocker, threads = await occupy(b, runner)
    first = submit(b, "a", work=work)
    await until(lambda: b.depth == 1)
    runner.gate.set()
    return first, blocker, threads


def test_under_load_a_batch_of_little_work_lingers_for_more_without_the_pipelining_cap() -> None:
    async def main() -> None:
        runner = FakeRunner()
        # A linger far longer than the test: only reaching linger_work can close this batch.
        b = Batcher(limits(pipeline=True, linger_work=10, max_linger_s=60.0))
        first, blocker, threads = await arrives_while_busy(b, runner, work=3, in_play=8)
        await blocker  # the runner is back for its next batch, and finds 3 of 10 queued
        rest = [submit(b, "b", work=3), submit(b, "c", work=4)]
        assert await asyncio.gather(first, *rest) == [("done", x) for x in "abc"]
        # One batch: without lingering "a" ran alone, and pipelining would have split the three.
        assert runner.batches == [["block"], ["a", "b", "c"]]
        await stop(b, threads)

    run(main())


def test_a_lingering_runner_is_woken_only_by_an_arrival_that_may_close_its_batch() -> None:
    # Each wake of a runner takes the GIL from the event loop and plans the batch again: under load, an
    # arrival that cannot close the batch must not wake it (Batcher._gathering).
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher(limits(pipeline=True, linger_work=10, max_linger_s=60.0))
        first, blocker, threads = await arrives_while_busy(b, runner, work=1, in_play=8)
        await blocker
        await until(lambda: b._gathering is not None)  # lingering: "a" holds 1 of 10
        wakes = 0
        notify = b._cond.notify

        def counted(n: int = 1) -> None:
            nonlocal wakes
            wakes += 1
            notify(n)

        b._cond.notify = counted  # type: ignore[method-assign]
        small = [submit(b, x, work=1) for x in "bcd"]  # 4 of 10: the batch cannot close yet
        other = submit(b, "z", work=9, group="h")  # another group waits its turn behind "a"
        await until(lambda: b.depth == 5)
        assert wakes == 0, "an arrival that cannot close the batch woke the runner"
        last = submit(b, "e", work=6)  # 10 of 10: closes it at once, long before the minute
        assert await asyncio.gather(first, *small, last) == [("done", x) for x in "abcde"]
        assert wakes >= 1 and await other == ("done", "z")
        assert runner.batches == [["block"], ["a", "b", "c", "d", "e"], ["z"]]
        await stop(b, threads)

    run(main())


def test_a_lingering_runner_whose_first_request_is_withdrawn_plans_again() -> None:
    # The runner waits for more of "a"'s group, woken only by arrivals that may close that batch. Once
    # "a" is cancelled the oldest request is another group's, whose arrivals must be heard.
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher(limits(pipeline=True, linger_work=10, max_linger_s=60.0))
        first, blocker, threads = await arrives_while_busy(b, runner, work=1, in_play=8)
        await blocker
        await until(lambda: b._gathering is not None and b._gathering.group == "g")
        other = submit(b, "z", work=5, group="h")
        await until(lambda: b.depth == 2)
        first.cancel()
        await until(lambda: b._gathering is not None and b._gathering.group == "h")
        last = submit(b, "y", work=5, group="h")  # 10 of 10 in "h": closes it long before the minute
        assert await asyncio.gather(other, last) == [("done", "z"), ("done", "y")]
        assert runner.batches == [["block"], ["z", "y"]]
        await stop(b, threads)

    run(main())


def test_a_lingering_batch_closes_once_every_request_in_play_is_in() -> None:
    async def main() -> None:
        runner = FakeRunner()
        # A linger far longer than the test, and far more work to wait for than comes.
        b = Batcher(limits(pipeline=True, linger_work=100, max_linger_s=60.0))
        blocker, threads = await occupy(b, runner)
        early = [submit(b, x, work=1) for x in "pqr"]  # four clients: "block" computing, three queued
        await until(lambda: b.depth == 3)
        runner.gate.set()
        # "block" is answered; its client sends again. Until then the three linger: four are in play.
        assert await blocker == ("done", "block")
        last = submit(b, "s", work=1)  # all four in: the batch closes now, not in a minute
        assert await asyncio.gather(*early, last) == [("done", x) for x in "pqrs"]
        assert runner.batches == [["block"], ["p", "q", "r", "s"]]
        await stop(b, threads)

    run(main())


def test_a_lingering_batch_forgets_the_clients_that_left_within_two_windows(monkeypatch) -> None:
    monkeypatch.setattr(batching, "IN_PLAY_WINDOW_S", 0.2)

    async def main() -> None:
        runner = FakeRunner()
        b = Batcher(limits(pipeline=True, linger_work=100, max_linger_s=60.0))
        # Eight were in play a moment ago: "a" lingers for the seven others.
        first, blocker, threads = await arrives_while_busy(b, runner, work=1, in_play=8)
        await blocker
        await until(lambda: b._gathering is not None)
        # Two windows pass with no one else sending (the load fell to two clients): the next arrival
        # finds every request in play in, and the batch closes now, not in a minute.
        await asyncio.sleep(2 * batching.IN_PLAY_WINDOW_S + 0.01)
        last = submit(b, "b", work=1)
        assert await asyncio.gather(first, last) == [("done", "a"), ("done", "b")]
        assert runner.batches == [["block"], ["a", "b"]]
        await stop(b, threads)

    run(main())


def test_a_runner_that_saw_no_arrivals_while_computing_takes_a_lone_request_at_once() -> None:
    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        # One client at a time (concurrency 1): nothing arrives while a batch computes, so a lingering
        # runner would hold each request the whole minute; the test's 20 s timeout would fail it.
        b = Batcher(limits(pipeline=True, linger_work=10, max_linger_s=60.0))
        threads = start(b, runner)
        for x in "abc":
            assert await submit(b, x, work=1) == ("done", x)
        assert runner.batches == [["a"], ["b"], ["c"]]
        await stop(b, threads)

    run(main())


@pytest.mark.parametrize(("work", "linger_s"), [(3, 0.05), (10, 60.0)])
def test_a_batch_lingers_at_most_max_linger_s_from_its_first_request_and_not_at_all_with_enough_work(
    work: int, linger_s: float
) -> None:
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher(limits(linger_work=10, max_linger_s=linger_s))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first, blocker, threads = await arrives_while_busy(b, runner, work)
        assert await first == ("done", "a")  # alone: nothing else came (60 s would time the test out)
        if work < 10:
            assert loop.time() - t0 >= linger_s
        assert runner.batches == [["block"], ["a"]] and await blocker == ("done", "block")
        await stop(b, threads)

    run(main())


def test_a_free_runner_takes_its_next_batch_without_the_event_loop() -> None:
    # Under load the loop is busy decoding and answering; the device must not wait for it. The loop
    # is held below, synchronously, while the runner finishes one batch: a runner that needed the
    # loop to hand it the next one would wait in vain.
    second = threading.Event()

    class Recording(FakeRunner):
        def __call__(self, items: list[object]) -> list[object]:
            if items == ["b", "c"]:
                second.set()
            return super().__call__(items)

    async def main() -> None:
        runner = Recording()
        b = Batcher(limits())
        threads = start(b, runner)
        first = submit(b, "a")
        await runner.started()
        rest = [submit(b, x) for x in "bc"]
        await until(lambda: b.depth == 2)
        runner.gate.set()
        assert second.wait(WAIT_S), "the runner did not take the queued batch while the loop was held"
        assert not first.done()  # its answer waits for the loop; the device did not
        assert await asyncio.gather(first, *rest) == [("done", x) for x in "abc"]
        await stop(b, threads)

    run(main())


def test_an_idle_runner_starts_a_request_without_another_trip_through_the_loop() -> None:
    # The caller's own step wakes the runner: an idle server adds no loop iteration between receipt
    # and compute (the loop is held below, synchronously, once the submit has run its first step).
    runner = FakeRunner()
    runner.gate.set()

    async def main() -> None:
        b = Batcher(limits())
        threads = start(b, runner)
        pending = submit(b, "a")
        await asyncio.sleep(0)  # one loop iteration: the submit task runs its first step
        assert runner.running.wait(WAIT_S)
        assert runner.batches == [["a"]] and b.depth == 0
        assert await pending == ("done", "a")
        await stop(b, threads)

    run(main())


def test_a_batch_closes_before_its_memory_estimate_passes_the_budget() -> None:
    async def main() -> None:
        runner = FakeRunner()
        # A long delay: only the limits can close these batches.
        b = Batcher(limits(max_queue_delay_s=60, max_batch_memory_bytes=100))
        memory = (60, 30, 50, 100)
        futures = [submit(b, i, memory=m) for i, m in enumerate(memory)]
        await until(lambda: b.depth == 4)  # all queued before any runner looks
        runner.gate.set()
        start(b, runner)
        # 60+30 fits and +50 would not; 50 alone, as +100 would not fit. The last waits for company.
        await until(lambda: len(runner.batches) == 2)
        assert runner.batches == [[0, 1], [2]] and b.depth == 1
        assert await b.drain(5) is True
        assert runner.batches == [[0, 1], [2], [3]]
        # Every result is set when drain returns; the callers' tasks resume on the loop's next turns
        # (Python 3.12 showed it). Anything left unanswered, drain's close would have failed.
        assert await asyncio.gather(*futures) == [("done", i) for i in range(4)]

    run(main())


def test_the_queue_refuses_past_its_byte_budget() -> None:
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher(limits(max_queue_bytes=100))
        blocker, threads = await occupy(b, runner)
        queued = submit(b, "a", nbytes=80)
        await until(lambda: b.depth == 1)
        with pytest.raises(QueueFull, match="max_queue_bytes 100"):
            await b.submit("b", sequences=1, length=1, group="g", nbytes=30)
        runner.gate.set()
        assert await queued == ("done", "a") and await blocker == ("done", "block")
        # Its bytes left the queue with it: the same request is admitted now.
        assert await b.submit("c", sequences=1, length=1, group="g", nbytes=30) == ("done", "c")
        await stop(b, threads)

    run(main())


def test_a_batch_closes_at_max_batch_size_counted_in_sequences() -> None:
    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        # A long delay: only the size limit can close these batches.
        b = Batcher(limits(max_batch_size=4, max_queue_delay_s=60))
        threads = start(b, runner)
        futures = [submit(b, i, sequences=2) for i in range(4)]
        results = await asyncio.gather(*futures)
        assert runner.batches == [[0, 1], [2, 3]]
        assert results == [("done", i) for i in range(4)]
        await stop(b, threads)

    run(main())


def test_a_batch_closes_at_max_batch_tokens_of_padded_length() -> None:
    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        b = Batcher(limits(max_batch_tokens=100, max_queue_delay_s=60))
        threads = start(b, runner)
        # 2 sequences x longest 40 = 80 fits; a third (3 x 50 = 150) does not.
        futures = [submit(b, "x", length=40), submit(b, "y", length=30), submit(b, "z", length=50)]
        await until(lambda: len(runner.batches) == 1)
        assert runner.batches == [["x", "y"]]
        await b.drain(5)  # drain runs what is left at once
        assert runner.batches == [["x", "y"], ["z"]]
        assert all(f.done() for f in futures)
        for t in threads:
            t.join(WAIT_S)

    run(main())


def test_the_delay_is_counted_from_the_first_request_of_the_batch() -> None:
    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        b = Batcher(limits(max_queue_delay_s=0.05))
        threads = start(b, runner)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        first = submit(b, "a")
        await asyncio.sleep(0.02)
        second = submit(b, "b")
        await asyncio.gather(first, second)
        elapsed = loop.time() - t0
        assert runner.batches == [["a", "b"]]
        # Closed by the first request's delay, not restarted by the second.
        assert 0.05 <= elapsed < 0.05 + 0.02 + 0.5
        await stop(b, threads)

    run(main())


def test_only_requests_of_the_same_group_share_a_batch_and_the_oldest_goes_first() -> None:
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher(limits())
        blocker, threads = await occupy(b, runner)
        futures = [
            submit(b, "s1", group="self"),
            submit(b, "c1", group="cross"),
            submit(b, "s2", group="self"),
        ]
        await until(lambda: b.depth == 3)
        runner.gate.set()
        await asyncio.gather(blocker, *futures)
        assert runner.batches == [["block"], ["s1", "s2"], ["c1"]]
        await stop(b, threads)

    run(main())


def test_a_full_queue_refuses_at_once() -> None:
    async def main() -> None:
        runner = FakeRunner()
        rec = Recorder()
        b = Batcher(limits(max_queue_size=2), rec)
        running, threads = await occupy(b, runner)
        waiting = [submit(b, "w1"), submit(b, "w2")]
        await until(lambda: b.depth == 2)
        with pytest.raises(QueueFull, match="queue is full"):
            await b.submit("over", sequences=1, length=1, group="g")
        assert rec.drops["queue_full"] == 1
        runner.gate.set()
        await asyncio.gather(running, *waiting)
        assert rec.batches == [1, 2] and rec.depths[-1] == 0
        await stop(b, threads)

    run(main())


def test_a_cancelled_request_is_dropped_before_compute() -> None:
    async def main() -> None:
        runner = FakeRunner()
        rec = Recorder()
        b = Batcher(limits(), rec)
        blocker, threads = await occupy(b, runner)
        keep, gone = submit(b, "keep"), submit(b, "gone")
        await until(lambda: b.depth == 2)
        gone.cancel()
        await until(lambda: b.depth == 1)
        runner.gate.set()
        await asyncio.gather(blocker, keep)
        assert runner.batches == [["block"], ["keep"]]
        assert rec.drops["cancelled"] == 1
        await stop(b, threads)

    run(main())


@pytest.mark.parametrize("expire", [True, False], ids=["timer", "no-timer"])
def test_a_request_whose_deadline_passed_in_the_queue_is_not_computed(expire: bool) -> None:
    # With a timer the loop fails it; without one (the RPC's own deadline was to cancel it, and its
    # cancellation has not arrived) the runner that reaches it drops it instead of computing it.
    async def main() -> None:
        runner = FakeRunner()
        rec = Recorder()
        b = Batcher(limits(), rec)
        loop = asyncio.get_running_loop()
        blocker, threads = await occupy(b, runner)
        expired = submit(b, "late", deadline=loop.time() - 1, expire=expire)  # already past when reached
        fresh = submit(b, "fresh", deadline=loop.time() + 60, expire=expire)
        await until(lambda: expired.done() or b.depth == 2)
        runner.gate.set()
        await asyncio.gather(blocker, fresh)
        with pytest.raises(DeadlineExpired):
            await expired
        assert runner.batches == [["block"], ["fresh"]]
        assert rec.drops["deadline_exceeded"] == 1
        await stop(b, threads)

    run(main())


def test_a_failing_batch_fails_only_its_own_requests_and_the_runner_keeps_serving() -> None:
    async def main() -> None:
        runner = FakeRunner(fail_on="bad")
        runner.gate.set()
        b = Batcher(limits(max_batch_size=1))
        threads = start(b, runner)
        with pytest.raises(BatchFailed, match="RuntimeError: boom"):
            await b.submit("bad", sequences=1, length=1, group="g")
        ok = await b.submit("good", sequences=1, length=1, group="g")
        assert ok == ("done", "good")
        await stop(b, threads)

    run(main())


def test_a_failing_batch_runs_again_one_request_at_a_time_so_only_the_failing_one_fails() -> None:
    async def main() -> None:
        runner = FakeRunner(fail_on="bad")
        reports: list[tuple[list[object], list[object] | None, str | None]] = []

        def done(items: list[object], results: list[object] | None, error: BaseException | None) -> None:
            reports.append((items, results, None if error is None else str(error)))

        b = Batcher(limits())
        b.start()
        threads = [threading.Thread(target=b.serve, args=(runner, done), daemon=True)]
        threads[0].start()
        blocker = submit(b, "block")
        await runner.started()
        rest = [submit(b, x) for x in ("a", "bad", "c")]
        await until(lambda: b.depth == 3)
        runner.gate.set()
        assert await blocker == ("done", "block")
        a, bad, c = await asyncio.gather(*rest, return_exceptions=True)
        assert (a, c) == (("done", "a"), ("done", "c"))
        assert isinstance(bad, BatchFailed)
        assert "alone after its batch of 3 failed: RuntimeError: boom" in str(bad)
        assert runner.batches == [["block"], ["a", "bad", "c"], ["a"], ["bad"], ["c"]]
        # The failed batch is reported failed, then each run alone as a batch of one.
        assert reports[1:] == [
            (["a", "bad", "c"], None, "boom"),
            (["a"], [("done", "a")], None),
            (["bad"], None, "boom"),
            (["c"], [("done", "c")], None),
        ]
        assert await submit(b, "after") == ("done", "after")  # the runner serves on
        await stop(b, threads)

    run(main())


@pytest.mark.parametrize("when", ["batch", "alone"])
def test_a_lost_worker_answers_its_batch_unavailable_stops_the_batcher_and_says_so(when: str) -> None:
    # Lost on the batch itself, or while a failed batch runs again alone: nothing more computes there.
    calls: list[list[object]] = []

    def runner(items: list[object]) -> list[object]:
        calls.append(list(items))
        if when == "alone" and len(items) > 1:
            raise RuntimeError("boom")
        raise WorkerLost("cuda:0 can compute no more: RuntimeError: CUDA error: device-side assert triggered")

    async def main() -> None:
        broken: list[BaseException] = []
        b = Batcher(limits(max_batch_size=2, max_queue_delay_s=WAIT_S * 4))  # closes at two
        b.on_broken(broken.append)
        threads = start(b, runner)
        results = await asyncio.gather(submit(b, "a"), submit(b, "b"), return_exceptions=True)
        assert all(isinstance(r, WorkerLost) and r.status == "UNAVAILABLE" for r in results)
        assert calls == ([["a", "b"]] if when == "batch" else [["a", "b"], ["a"]])
        await until(lambda: bool(broken))
        assert isinstance(broken[0], WorkerLost)
        with pytest.raises(BatcherStopped, match=r"batcher stopped.*the server is stopping") as err:
            await b.submit("after", sequences=1, length=1, group="g")
        assert err.value.status == "UNAVAILABLE"
        await until(lambda: not threads[0].is_alive())
        await stop(b, threads)

    run(main())


def test_the_oldest_batch_in_flight_is_timed_for_the_watchdog() -> None:
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher(limits())
        assert b.oldest_in_flight_s() == 0.0
        blocker, threads = await occupy(b, runner)
        first = b.oldest_in_flight_s()
        await until(lambda: b.oldest_in_flight_s() > first)  # it grows while the batch computes
        runner.gate.set()
        await blocker
        await until(lambda: b.oldest_in_flight_s() == 0.0)
        await stop(b, threads)

    run(main())


def test_a_runner_returning_the_wrong_number_of_results_fails_the_batch() -> None:
    async def main() -> None:
        def short(items: list[object]) -> list[object]:
            return items[:-1]

        b = Batcher(limits())
        threads = start(b, short)
        with pytest.raises(BatchFailed, match="0 results for 1 requests"):
            await b.submit("x", sequences=1, length=1, group="g")
        await stop(b, threads)

    run(main())


def test_two_runners_compute_two_batches_at_once() -> None:
    async def main() -> None:
        r1, r2 = FakeRunner(), FakeRunner()
        b = Batcher(limits(max_batch_size=1))
        threads = start(b, r1, r2)
        f1, f2 = submit(b, 1), submit(b, 2)
        await r1.started()
        await r2.started()  # both busy at the same time
        r1.gate.set()
        r2.gate.set()
        await asyncio.gather(f1, f2)
        assert sorted(r1.batches + r2.batches) == [[1], [2]]
        await stop(b, threads)

    run(main())


def test_drain_runs_queued_work_at_once_and_then_refuses_new_requests() -> None:
    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        b = Batcher(limits(max_queue_delay_s=3600))
        threads = start(b, runner)
        queued = [submit(b, i) for i in range(3)]
        await until(lambda: b.depth == 3)
        assert await b.drain(5) is True
        assert await asyncio.gather(*queued) == [("done", i) for i in range(3)]  # (as in the memory-budget test)
        with pytest.raises(ShuttingDown):
            await b.submit("late", sequences=1, length=1, group="g")
        await stop(b, threads)

    run(main())


def test_a_drain_with_no_time_and_nothing_left_has_drained() -> None:
    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        b = Batcher(limits())
        threads = start(b, runner)
        assert await submit(b, "done") == ("done", "done")
        assert await b.drain(0) is True  # --grace-s 0 on an idle server: nothing ran out
        await stop(b, threads)

    run(main())


def test_a_drain_with_no_time_starts_nothing_queued_and_fails_it_unavailable() -> None:
    # --grace-s 0 with a request held in the queue (its batch waits for company): the runner must not
    # take it, however quickly it would run. Before, the drain woke the runners and then looked whether
    # anything was left: a runner quicker than that look answered the request OK (a CI failure of
    # test_process's grace test). The depth report between the two stands still here until the runner
    # has run or the batcher has stopped, so a runner that gets the chance always takes it.
    class SlowReport(Recorder):
        def queue_depth(self, depth: int) -> None:
            super().queue_depth(depth)
            deadline = time.monotonic() + WAIT_S
            while armed and not runner.running.is_set() and not b._stopped and time.monotonic() < deadline:
                time.sleep(0.001)

    armed = False
    runner = FakeRunner()
    runner.gate.set()
    b = Batcher(limits(max_queue_delay_s=60), SlowReport())

    async def main() -> None:
        nonlocal armed
        threads = start(b, runner)
        held = submit(b, "held")
        await until(lambda: b.depth == 1)
        armed = True
        assert await b.drain(0) is False
        with pytest.raises(ShuttingDown):
            await held
        await stop(b, threads)
        assert runner.batches == []

    run(main())


def test_drain_that_runs_out_of_time_fails_what_is_left_unavailable() -> None:
    async def main() -> None:
        runner = FakeRunner()  # held shut until the end
        b = Batcher(limits(max_batch_size=1))
        threads = start(b, runner)
        stuck, waiting = submit(b, "stuck"), submit(b, "waiting")
        await runner.started()
        assert await b.drain(0.05) is False
        for f in (stuck, waiting):
            with pytest.raises(ShuttingDown):
                await f
        runner.gate.set()  # the batch it was running ends; it computes nothing more
        await stop(b, threads)
        assert runner.batches == [["stuck"]]

    run(main())


def test_a_bug_while_a_batch_forms_fails_the_waiting_callers_instead_of_stranding_them() -> None:
    # A length that cannot be compared stands for any bug in batch formation, which runs on the
    # runner's thread: the batcher stops, and every caller, waiting or later, gets an error.
    async def main() -> None:
        runner = FakeRunner()
        b = Batcher(limits())
        blocker, threads = await occupy(b, runner)
        waiting = [submit(b, "fine"), submit(b, "bad", length=None)]  # type: ignore[arg-type]
        await until(lambda: b.depth == 2)
        runner.gate.set()
        await blocker
        for f in waiting:
            with pytest.raises(ServingError, match="batcher stopped"):
                await asyncio.wait_for(f, WAIT_S)
        with pytest.raises(ServingError, match="batcher stopped"):
            await b.submit("after", sequences=1, length=1, group="g")
        assert runner.batches == [["block"]]
        await stop(b, threads)

    run(main())


@pytest.mark.parametrize("report", ["queue_depth", "batch_started"])
def test_a_failing_report_is_logged_and_every_caller_still_answered(report: str) -> None:
    class BrokenObserver(Recorder):
        def queue_depth(self, depth: int) -> None:
            if report == "queue_depth":
                raise RuntimeError("observer bug")

        def batch_started(self, requests: int, queue_waits_s: list[float]) -> None:
            if report == "batch_started":
                raise RuntimeError("observer bug")

    async def main() -> None:
        runner = FakeRunner()
        runner.gate.set()
        b = Batcher(limits(), BrokenObserver())
        threads = start(b, runner)
        assert await asyncio.gather(submit(b, 1), submit(b, 2)) == [("done", 1), ("done", 2)]
        assert await b.submit(3, sequences=1, length=1, group="g") == ("done", 3)
        await stop(b, threads)

    run(main())


def test_a_queued_request_expires_at_its_deadline_while_every_runner_is_busy() -> None:
    async def main() -> None:
        runner = FakeRunner()
        rec = Recorder()
        b = Batcher(limits(), rec)
        loop = asyncio.get_running_loop()
        blocker, threads = await occupy(b, runner)
        late = submit(b, "late", deadline=loop.time() + 0.05)
        with pytest.raises(DeadlineExpired):
            await late  # the runner is still held: no batch forms, the deadline alone ends it
        assert b.depth == 0 and rec.drops["deadline_exceeded"] == 1
        runner.gate.set()
        await blocker
        assert runner.batches == [["block"]]
        await stop(b, threads)

    run(main())


def test_close_lets_an_idle_runner_return_and_a_serving_runner_finish_first() -> None:
    async def main() -> None:
        idle, busy = FakeRunner(), FakeRunner()
        b = Batcher(limits(max_batch_size=1))
        threads = start(b, idle, busy)
        pending = submit(b, "x")
        await until(lambda: idle.running.is_set() or busy.running.is_set())
        await b.close()
        with pytest.raises(ShuttingDown, match="while this request ran"):
            await pending
        idle.gate.set()
        busy.gate.set()
        await stop(b, threads)

    run(main())


def test_a_runner_returns_when_its_event_loop_is_gone_without_a_close() -> None:
    # A server that dies without closing its batcher must not leave a thread behind: exiting Python
    # joins executor threads, and one that served forever would hang the exit.
    b: Batcher = Batcher(limits())

    async def main() -> list[threading.Thread]:
        return start(b, FakeRunner())

    threads = asyncio.run(main())
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive()


def test_many_callers_racing_two_runners_each_get_exactly_one_outcome() -> None:
    # Submissions, cancellations and deadlines race two runners that take batches on their own
    # threads: no item runs twice, every caller ends with its own result, an expiry or its
    # cancellation, each drop is counted once, and the queue ends empty.
    import random

    rng = random.Random(7)
    computed: Counter[int] = Counter()
    lock = threading.Lock()

    def runner(items: list[object]) -> list[object]:
        with lock:
            computed.update(items)  # type: ignore[arg-type]
        return [("done", item) for item in items]

    async def main() -> None:
        rec = Recorder()
        b = Batcher(limits(max_batch_size=4, max_queue_size=1000), rec)
        threads = start(b, runner, runner)
        loop = asyncio.get_running_loop()
        futures: dict[int, asyncio.Future] = {}
        for i in range(600):
            deadline = loop.time() + rng.choice([-1.0, 0.002, 60.0])
            futures[i] = submit(b, i, length=rng.randint(1, 4), deadline=deadline, expire=rng.random() < 0.5)
            if rng.random() < 0.2:
                await asyncio.sleep(0)
            if rng.random() < 0.15:
                futures[rng.randrange(i + 1)].cancel()
        await asyncio.gather(*futures.values(), return_exceptions=True)
        outcomes: Counter[str] = Counter()
        for i, f in futures.items():
            if f.cancelled():
                outcomes["cancelled"] += 1
            elif f.exception() is not None:
                assert isinstance(f.exception(), DeadlineExpired), f.exception()
                outcomes["expired"] += 1
            else:
                assert f.result() == ("done", i)
                outcomes["done"] += 1
        assert all(n == 1 for n in computed.values())  # nothing computed twice
        assert set(computed) >= {i for i, f in futures.items() if not f.cancelled() and f.exception() is None}
        assert outcomes["done"] and outcomes["expired"] and outcomes["cancelled"]
        assert rec.drops["deadline_exceeded"] >= outcomes["expired"]  # and a cancel past its deadline counts there
        assert rec.drops["deadline_exceeded"] + rec.drops["cancelled"] <= outcomes["expired"] + outcomes["cancelled"]
        assert b.depth == 0 and await b.drain(WAIT_S) is True
        await stop(b, threads)

    run(main())


def test_a_runner_that_dies_mid_batch_answers_that_batch_and_stops_the_batcher() -> None:
    # Not an Exception (a BaseException the runner cannot serve on after): its own batch is
    # answered, not stranded in flight, and the batcher refuses from then on.
    class Fatal(BaseException):
        pass

    def dying(items: list[object]) -> list[object]:
        raise Fatal("the worker's thread is done for")

    async def main() -> None:
        b = Batcher(limits())
        threads = start(b, dying)
        with pytest.raises(BatchFailed, match="Fatal: the worker's thread is done for"):
            await b.submit("x", sequences=1, length=1, group="g")
        await until(lambda: not threads[0].is_alive())
        with pytest.raises(ServingError, match="batcher stopped"):
            await b.submit("after", sequences=1, length=1, group="g")
        assert await b.drain(WAIT_S) is True  # nothing left in flight
        await stop(b, threads)

    run(main())


class PairedRunner:
    """A runner that may pair (Batcher.serve's `shared`): records each batch as ("whole" | "shared",
    items); each run waits for a permit of its own the test releases, so batches end when it says."""

    def __init__(self, log: list[tuple[str, str, list[object]]], name: str) -> None:
        self.log, self.name = log, name
        self.permits = threading.Semaphore(0)
        self.started = 0

    def _run(self, kind: str, items: list[object]) -> list[object]:
        self.log.append((self.name, kind, list(items)))
        self.started += 1
        assert self.permits.acquire(timeout=WAIT_S * 4), "the test never let the batch end"
        return [("done", item) for item in items]

    def whole(self, items: list[object]) -> list[object]:
        return self._run("whole", items)

    def shared(self, items: list[object]) -> list[object]:
        return self._run("shared", items)


def start_pair(b: Batcher) -> tuple[PairedRunner, PairedRunner, list, list[threading.Thread]]:
    """Starts the batcher with a first runner and a second one (pairing)."""
    log: list[tuple[str, str, list[object]]] = []
    first, second = PairedRunner(log, "first"), PairedRunner(log, "second")
    b.start()
    threads = [
        threading.Thread(target=b.serve, args=(first.whole,), kwargs={"shared": first.shared}, daemon=True),
        threading.Thread(
            target=b.serve, args=(second.whole,), kwargs={"shared": second.shared, "second": True}, daemon=True
        ),
    ]
    for t in threads:
        t.start()
    return first, second, log, threads


def test_pairing_splits_a_batch_of_twice_pair_work_into_halves_that_compute_side_by_side() -> None:
    async def main() -> None:
        b = Batcher(limits(pair_work=10, max_batch_size=64))
        first, second, log, threads = start_pair(b)
        blocker = submit(b, "block", work=5)  # short of 2 x 10: whole, on the first runner
        await until(lambda: first.started == 1)
        rest = [submit(b, x, work=5) for x in "abcdefgh"]  # 40 together
        await until(lambda: b.depth == 8)
        assert second.started == 0  # the first runner holds every thread: the second takes nothing
        first.permits.release()
        await until(lambda: first.started == 2 and second.started == 1)  # both halves computing at once
        assert log[1:] == [("first", "shared", list("abcd")), ("second", "shared", list("efgh"))]
        # While the second computes its half, a free first runner takes what arrives as shared too.
        first.permits.release()
        await asyncio.gather(blocker, *rest[:4])
        late = submit(b, "i", work=5)
        await until(lambda: first.started == 3)
        assert log[3] == ("first", "shared", ["i"])
        second.permits.release()
        first.permits.release()
        assert await asyncio.gather(*rest[4:], late) == [("done", x) for x in "efghi"]
        # Both idle again: a batch short of twice pair_work computes whole.
        small = [submit(b, x, work=5) for x in "jk"]
        await until(lambda: first.started == 4)
        first.permits.release()
        await asyncio.gather(*small)
        assert log[4] == ("first", "whole", ["j", "k"]) and second.started == 1
        await stop(b, threads)

    run(main())


def test_without_pair_work_a_second_runner_takes_nothing_and_batches_stay_whole() -> None:
    async def main() -> None:
        b = Batcher(limits(max_batch_size=64))
        first, second, log, threads = start_pair(b)
        blocker = submit(b, "block", work=50)
        assert second.started == 0
        await until(lambda: first.started == 1)
        rest = [submit(b, x, work=50) for x in "abcd"]
        await until(lambda: b.depth == 4)
        first.permits.release(2)
        await asyncio.gather(blocker, *rest)
        assert log == [("first", "whole", ["block"]), ("first", "whole", list("abcd"))] and second.started == 0
        await stop(b, threads)

    run(main())


def test_a_drain_runs_both_halves_of_a_paired_batch_and_stops_both_runners() -> None:
    async def main() -> None:
        b = Batcher(limits(pair_work=1, max_batch_size=64))
        first, second, log, threads = start_pair(b)
        blocker = submit(b, "block")
        await until(lambda: first.started == 1)
        rest = [submit(b, x, work=1) for x in "abcd"]
        await until(lambda: b.depth == 4)
        first.permits.release(5)
        second.permits.release(5)
        assert await b.drain(WAIT_S) is True
        assert await asyncio.gather(blocker, *rest) == [("done", x) for x in ["block", *"abcd"]]
        assert log[1][1] == "shared"  # a paired half; the runners then race for the rest
        assert sorted(x for _, _, items in log[1:] for x in items) == list("abcd")  # each once
        await stop(b, threads)

    run(main())
